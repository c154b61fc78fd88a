"""FP4 E2M1: the 4-bit element type of NVFP4 and MXFP4 (reference implementation).

Math
----
A code is 4 bits ``s e1 e0 m``: sign in bit 3, exponent bias 1, one mantissa bit, no Inf, no NaN.

    code (low 3 bits)  0    1    2    3    4    5    6    7
    magnitude          0    0.5  1    1.5  2    3    4    6

Encoding rounds to nearest, ties to even (the code with mantissa bit 0, i.e. an even code).
The midpoint between code ``i`` and code ``i + 1`` is ``MIDPOINTS[i]``; a magnitude moves
past it when it is greater (``i`` even: a tie stays on the even code ``i``) or greater or
equal (``i`` odd: a tie goes up to the even code ``i + 1``). The code is the number of
midpoints passed, so anything above 5 (``+Inf`` included) saturates to 6.

Sign: taken from the sign bit, so ``-0.0`` and negative values that round to zero encode as
code 8 (``-0``), as ``ml_dtypes`` and IEEE conversions do (ModelOpt's exporter writes code 0
for an exact ``-0.0``; the dequantized value is the same).

NaN policy: E2M1 has no NaN, so a NaN encodes to code 7 (``+6``), the saturating choice
(ModelOpt's exporter also gives 7; ``ml_dtypes`` gives 8). Block formats keep NaN visible
through their block scale instead: see ``mx.quantize_mx`` and ``nvfp4.quantize_nvfp4``.

Packing (ModelOpt, Quark, compressed-tensors, torchao alike): two codes per byte, element
``2i`` in the LOW nibble and element ``2i + 1`` in the high nibble.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernelbay.capture import is_capturing

__all__ = [
    "E2M1_MAX",
    "decode_e2m1",
    "encode_e2m1",
    "pack_e2m1",
    "unpack_e2m1",
]

E2M1_MAX = 6.0
"""The largest E2M1 magnitude."""

_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_NAN_CODE = 7
_SIGN = 8


def encode_e2m1(x: Tensor) -> Tensor:
    """Round ``x`` to E2M1 codes (uint8 in 0..15, sign in bit 3), ties to even, saturating at ±6.

    Every floating dtype is compared exactly (the midpoints are exact in all of them). NaN
    encodes to code 7 (+6); ``-0.0`` to code 8. The output has the shape of ``x``.
    """
    if not x.is_floating_point():
        raise TypeError(f"encode_e2m1 wants a floating-point tensor, got dtype {x.dtype}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        x = x.float()  # fp8 inputs: exact widening
    mag = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for i, mid in enumerate(_MIDPOINTS):
        passed = mag > mid if i % 2 == 0 else mag >= mid
        code += passed.to(torch.uint8)
    code |= torch.signbit(x).to(torch.uint8) << 3
    return torch.where(torch.isnan(x), _NAN_CODE, code).to(torch.uint8)


def decode_e2m1(codes: Tensor) -> Tensor:
    """Map E2M1 codes (uint8 in 0..15) to their float32 values; code 8 is ``-0.0``."""
    _check_codes(codes, "decode_e2m1")
    # From the bits (s eem), not a table: a table would be copied to the device at each call.
    c = codes.to(torch.int32)
    exp, man = (c >> 1) & 3, (c & 1).to(torch.float32)
    mag = torch.where(exp == 0, man * 0.5, torch.exp2((exp - 1).to(torch.float32)) * (1 + man * 0.5))
    return torch.where((c & 8) != 0, -mag, mag)


def pack_e2m1(codes: Tensor) -> Tensor:
    """Pack codes ``[..., K]`` into bytes ``[..., K/2]``: element 2i low nibble, 2i+1 high.

    ``K`` must be even.
    """
    _check_codes(codes, "pack_e2m1")
    k = codes.shape[-1] if codes.dim() else 0
    if codes.dim() == 0 or k % 2:
        raise ValueError(
            f"pack_e2m1: the last dimension K={k} (shape {tuple(codes.shape)}) must be even: "
            "two E2M1 codes go in one byte"
        )
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: Tensor) -> Tensor:
    """Unpack bytes ``[..., K/2]`` into codes ``[..., K]`` (low nibble first)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_e2m1 wants uint8 bytes, got dtype {packed.dtype}")
    if packed.dim() == 0:
        raise ValueError("unpack_e2m1 wants at least one dimension, got a 0-d tensor")
    pairs = torch.stack((packed & 0x0F, packed >> 4), dim=-1)
    return pairs.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def _check_codes(codes: Tensor, who: str) -> None:
    if codes.dtype != torch.uint8:
        raise TypeError(f"{who} wants uint8 codes, got dtype {codes.dtype}")
    if codes.numel() and not is_capturing(codes) and int(codes.max()) > 15:
        raise ValueError(f"{who}: codes must be in 0..15, got a maximum of {int(codes.max())}")
