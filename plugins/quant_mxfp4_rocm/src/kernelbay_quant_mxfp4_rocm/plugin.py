"""kernelbay entry point of the MXFP4 (ROCm) plugin: the Quark format and MX linear methods.

Discovery imports this module; it and the class modules import neither torch nor triton
(the Triton kernels live in ``triton_gemm`` / ``triton_mx``, imported when a method runs).
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
    """AMD Quark checkpoints."""
    from kernelbay_quant_mxfp4_rocm.quark_format import QuarkFormat

    return [QuarkFormat]


@hookimpl
def kernelbay_linear_methods() -> Sequence[type[LinearMethod]]:
    """The reference OCP MXFP4 linear methods (dense and routed experts), their Triton
    counterparts for ROCm, and the CUDA verification candidate (only when forced).

    Reads the MoE backend choice (``KERNELBAY_MXFP4_MOE_BACKEND``) once, here: an invalid
    value fails the plugin's load with the variable, the value and the valid set.
    """
    from kernelbay_quant_mxfp4_rocm.emulation import Mxfp4EmulationLinear
    from kernelbay_quant_mxfp4_rocm.moe import Mxfp4MoEEmulation
    from kernelbay_quant_mxfp4_rocm.moe_backend import load_choice
    from kernelbay_quant_mxfp4_rocm.triton_linear import Mxfp4TritonCudaLinear, Mxfp4TritonLinear
    from kernelbay_quant_mxfp4_rocm.triton_moe import Mxfp4MoETriton

    load_choice()
    return [Mxfp4EmulationLinear, Mxfp4MoEEmulation, Mxfp4TritonLinear, Mxfp4TritonCudaLinear,
            Mxfp4MoETriton]
