"""The core's plugin conformance suite, run over this plugin's classes."""

from __future__ import annotations

from typing import ClassVar

from kernelbay import AttentionRequest, BackendKind
from kernelbay.testing import PluginConformance


class TestConformance(PluginConformance):
    """Contract checks for the ``attn_flashmla`` plugin, with every record kind asked."""

    plugin = "attn_flashmla"
    extra_requests: ClassVar[dict[BackendKind, list[object]]] = {
        BackendKind.ATTENTION: [
            AttentionRequest("mla", 16, 1, 192, 128, 448, 64, kv_cache="fp8-e8m0", page_size=64),
            AttentionRequest("mla", 16, 1, 192, 128, 512, 64, kv_cache="fp8-e8m0"),
            AttentionRequest("mla", 16, 1, 192, 128, 512, 64, kv_cache="bf16", dtype="float32"),
            AttentionRequest("mla", 16, 1, 192, 128, 512, 64, dtype="float16"),
            AttentionRequest("mla", 16, 1, 192, 128, 512, 64, page_size=0),
            AttentionRequest("mla", 16, 2, 192, 128, 512, 64),
            AttentionRequest("mla", 16, 1, 192, 128, None, None),
        ],
    }
