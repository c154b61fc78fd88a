"""Entry point of kernelbay-attn-flashmla: the ``mla-triton`` and ``mla-reference`` attention
backends.

Discovery imports this module; it and ``backend`` import no torch at module level.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kernelbay import hookimpl

if TYPE_CHECKING:
    from kernelbay.layers import AttentionBackend

KERNELBAY_PLUGIN_API = "1.0"


@hookimpl
def kernelbay_attention_backends() -> Sequence[type[AttentionBackend]]:
    """MLA attention over compact records: Triton kernels (cc >= 9.0) and the torch reference."""
    from kernelbay_attn_flashmla.backend import MLAReferenceAttention
    from kernelbay_attn_flashmla.triton_backend import MLATritonAttention

    return [MLATritonAttention, MLAReferenceAttention]
