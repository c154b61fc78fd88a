"""Entry point of kernelbay-attn-flashmla: the ``mla-reference`` attention backend.

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
    """MLA attention over compact records, in plain torch."""
    from kernelbay_attn_flashmla.backend import MLAReferenceAttention

    return [MLAReferenceAttention]
