"""The KV-cache record option: ``LLM(kv_cache=...)`` reaches the attention request, and a
record kind no installed backend stores fails naming the plugin to install."""

from __future__ import annotations

import pytest
from kernelbay.demo import demo_path
from kernelbay.engine import LLM, KVCacheConfig
from kernelbay.errors import NoBackendError
from kernelbay.plugins import Registry
from kernelbay.policy import Policy
from kernelbay.requests import AttentionRequest

CORE_ONLY = Registry(Policy(plugins=frozenset()))


@pytest.mark.parametrize("kind", ["fp8", "fp8-e8m0", "mxfp8"])
def test_quantized_records_without_the_plugin_name_it(kind: str) -> None:
    with pytest.raises(NoBackendError) as info:
        LLM(demo_path(), registry=CORE_ONLY, kv_cache=kind)
    text = str(info.value)
    assert f"kv cache {kind}" in text
    assert "pip install kernelbay-attn-flashmla" in text


@pytest.mark.parametrize("option", ["bf16", KVCacheConfig("bf16", page_size=8)])
def test_the_record_kind_reaches_the_attention_request(option: str | KVCacheConfig) -> None:
    llm = LLM(demo_path(), registry=CORE_ONLY, kv_cache=option)
    request = llm.plan.attention.request
    assert isinstance(request, AttentionRequest)
    assert request.kv_cache == "bf16" and request.attention == "mla"
    assert request.page_size == (8 if isinstance(option, KVCacheConfig) else 16)
    assert llm.plan.attention.selection is not None
    assert llm.plan.attention.selection.backend.name == "torch-mla"
