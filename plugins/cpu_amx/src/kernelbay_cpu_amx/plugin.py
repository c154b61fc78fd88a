"""kernelbay entry point of the x86 CPU plugin: linear and routed-expert methods and the
``hf-fp8`` format (which also writes checkpoints).

Discovery imports this module; it and the class modules import neither torch nor the
compiled kernels (those load when a layer is built).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kernelbay import hookimpl

if TYPE_CHECKING:
    from kernelbay.layers import CheckpointFormat, LinearMethod

KERNELBAY_PLUGIN_API = "1.0"


@hookimpl
def kernelbay_linear_methods() -> Sequence[type[LinearMethod]]:
    """FP8 W8A16 and bf16 linear methods and FP8 routed experts for AVX512-BF16 (and AMX)
    CPUs."""
    from kernelbay_cpu_amx.linear import CpuBf16Avx512Linear, CpuFp8Avx512Linear
    from kernelbay_cpu_amx.moe import CpuFp8MoE

    return [CpuFp8Avx512Linear, CpuBf16Avx512Linear, CpuFp8MoE]


@hookimpl
def kernelbay_checkpoint_formats() -> Sequence[type[CheckpointFormat]]:
    """Hugging Face fine-grained FP8 checkpoints."""
    from kernelbay_cpu_amx.hf_fp8_format import HfFp8Format

    return [HfFp8Format]
