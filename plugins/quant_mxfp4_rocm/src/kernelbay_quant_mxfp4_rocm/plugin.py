"""kernelbay entry point of the MXFP4 (ROCm) plugin: the Quark format and MX linear methods.

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
    """AMD Quark checkpoints."""
    from kernelbay_quant_mxfp4_rocm.quark_format import QuarkFormat

    return [QuarkFormat]


@hookimpl
def kernelbay_linear_methods() -> Sequence[type[LinearMethod]]:
    """The reference OCP MXFP4 linear method and its routed-expert sibling."""
    from kernelbay_quant_mxfp4_rocm.emulation import Mxfp4EmulationLinear
    from kernelbay_quant_mxfp4_rocm.moe import Mxfp4MoEEmulation

    return [Mxfp4EmulationLinear, Mxfp4MoEEmulation]
