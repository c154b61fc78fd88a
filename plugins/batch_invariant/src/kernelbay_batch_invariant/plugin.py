"""Entry point of kernelbay-batch-invariant: the ``bi-triton-linear`` / ``bi-triton-moe``
linear methods and the ``bi-triton-paged`` / ``bi-triton-mla`` attention backends.

Discovery imports this module; it and the class modules import no torch or triton at
module level (the kernels live in ``kernels``, imported when a layer runs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kernelbay import hookimpl

if TYPE_CHECKING:
    from kernelbay.layers import AttentionBackend, LinearMethod

KERNELBAY_PLUGIN_API = "1.0"


@hookimpl
def kernelbay_linear_methods() -> Sequence[type[LinearMethod]]:
    """The batch-invariant Triton matmul for unquantized weights and routed experts."""
    from kernelbay_batch_invariant.linear import BatchInvariantLinear
    from kernelbay_batch_invariant.moe import BatchInvariantMoE

    return [BatchInvariantLinear, BatchInvariantMoE]


@hookimpl
def kernelbay_attention_backends() -> Sequence[type[AttentionBackend]]:
    """Batch-invariant paged attention (MHA/GQA/MQA and absorbed MLA)."""
    from kernelbay_batch_invariant.attention import (
        BatchInvariantMLAAttention,
        BatchInvariantPagedAttention,
    )

    return [BatchInvariantPagedAttention, BatchInvariantMLAAttention]
