"""Reference implementations of the number formats, in plain torch.

One per format, short and obviously right: every fast kernel is tested against these.
Each module starts with its math. ``import kernelbay`` does not import this package (it
imports torch); backends import it when they are built.
"""

from kernelbay.formats.e2m1 import E2M1_MAX, decode_e2m1, encode_e2m1, pack_e2m1, unpack_e2m1
from kernelbay.formats.e2m1_words import (
    GATHER_MASK,
    GATHER_MULTIPLIER,
    LANE_MASK,
    LANE_ROTATIONS,
    checkpoint_layout,
    fragment_k_order,
    repack_e2m1_words,
    unpack_e2m1_words,
    word_bit_positions,
    words_order,
)
from kernelbay.formats.e4m3 import E4M3_MAX, e4m3_bits, from_e4m3_bits, to_e4m3
from kernelbay.formats.e8m0 import E8M0_BIAS, E8M0_NAN, decode_e8m0, encode_e8m0
from kernelbay.formats.fp8 import (
    FP8_BLOCK,
    dequantize_fp8_per_block,
    dequantize_fp8_per_tensor,
    quantize_fp8_per_block,
    quantize_fp8_per_tensor,
)
from kernelbay.formats.mx import (
    MX_BLOCK,
    MXElem,
    ScaleRule,
    dequantize_mx,
    mx_block_exponent,
    quantize_mx,
)
from kernelbay.formats.nvfp4 import (
    NVFP4_BLOCK,
    compressed_tensors_global_scale,
    dequantize_nvfp4,
    nvfp4_global_scale,
    quantize_nvfp4,
)

__all__ = [
    "E2M1_MAX",
    "E4M3_MAX",
    "E8M0_BIAS",
    "E8M0_NAN",
    "FP8_BLOCK",
    "GATHER_MASK",
    "GATHER_MULTIPLIER",
    "LANE_MASK",
    "LANE_ROTATIONS",
    "MX_BLOCK",
    "NVFP4_BLOCK",
    "MXElem",
    "ScaleRule",
    "checkpoint_layout",
    "compressed_tensors_global_scale",
    "decode_e2m1",
    "decode_e8m0",
    "dequantize_fp8_per_block",
    "dequantize_fp8_per_tensor",
    "dequantize_mx",
    "dequantize_nvfp4",
    "e4m3_bits",
    "encode_e2m1",
    "encode_e8m0",
    "fragment_k_order",
    "from_e4m3_bits",
    "mx_block_exponent",
    "nvfp4_global_scale",
    "pack_e2m1",
    "quantize_fp8_per_block",
    "quantize_fp8_per_tensor",
    "quantize_mx",
    "quantize_nvfp4",
    "repack_e2m1_words",
    "to_e4m3",
    "unpack_e2m1",
    "unpack_e2m1_words",
    "word_bit_positions",
    "words_order",
]
