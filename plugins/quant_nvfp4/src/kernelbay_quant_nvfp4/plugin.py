"""kernelbay entry point of the NVFP4 plugin: checkpoint formats and linear methods.

Discovery imports this module; it and the class modules import neither torch nor triton.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kernelbay import hookimpl

if TYPE_CHECKING:
    from kernelbay.layers import CheckpointFormat, LinearMethod

KERNELBAY_PLUGIN_API = "1.0"


@hookimpl
def kernelbay_checkpoint_formats() -> Sequence[type[CheckpointFormat]]:
    """ModelOpt checkpoints and compressed-tensors NVFP4 checkpoints."""
    from kernelbay_quant_nvfp4.compressed_tensors_format import CompressedTensorsNvfp4Format
    from kernelbay_quant_nvfp4.modelopt_format import ModelOptFormat

    return [ModelOptFormat, CompressedTensorsNvfp4Format]


@hookimpl
def kernelbay_linear_methods() -> Sequence[type[LinearMethod]]:
    """The reference NVFP4 linear method (dequantize, then F.linear) and its MoE sibling,
    the Triton weight-only kernel (GPUs), the native W4A4 path (compute capability 10.x) and
    FP8_PB_WO weight-only with internal padding."""
    from kernelbay_quant_nvfp4.emulation import Nvfp4EmulationLinear
    from kernelbay_quant_nvfp4.fp8_block import Fp8BlockTritonLinear
    from kernelbay_quant_nvfp4.fused_moe import Nvfp4MoETriton
    from kernelbay_quant_nvfp4.linear_triton import Nvfp4TritonLinear
    from kernelbay_quant_nvfp4.moe import Nvfp4MoEEmulation
    from kernelbay_quant_nvfp4.native_w4a4 import Nvfp4NativeW4A4Linear

    return [Nvfp4EmulationLinear, Nvfp4MoEEmulation, Nvfp4TritonLinear, Nvfp4NativeW4A4Linear,
            Fp8BlockTritonLinear, Nvfp4MoETriton]
