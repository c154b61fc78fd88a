"""The demo model (DeepSeek-V3 architecture, 64+16 latents) runs with every record kind.

On CPU the records are served by ``mla-reference``: bf16 records give the engine's
reference path token for token, and each quantized kind keeps held-out bits per byte within
2% of bf16 (on the first ``HELDOUT_BYTES`` of the held-out text, to keep the test short).
"""

from __future__ import annotations

import pytest
from kernelbay.demo import demo_path, heldout_text
from kernelbay.demo.evaluate import bits_per_byte
from kernelbay.engine import LLM, SamplingParams
from kernelbay.plugins import Registry
from kernelbay.policy import Policy
from kernelbay.requests import AttentionRequest

CORE_ONLY = Registry(Policy(plugins=frozenset()))
PROMPTS = ["def read_config(path):\n", "The ", "import numpy as np\n\nx = "]
HELDOUT_BYTES = 16384


@pytest.fixture(scope="module")
def bf16_bits() -> float:
    return bits_per_byte(LLM(demo_path(), kv_cache="bf16", device="cpu").logits,
                         heldout_text()[:HELDOUT_BYTES])


def test_bf16_records_greedy_equals_the_reference_path() -> None:
    params = SamplingParams(max_tokens=24)
    ours = LLM(demo_path(), kv_cache="bf16", device="cpu")
    assert ours.plan.attention.selection is not None
    assert ours.plan.attention.selection.backend.name == "mla-reference"
    reference = LLM(demo_path(), registry=CORE_ONLY, device="cpu")
    assert reference.plan.attention.selection is not None
    assert reference.plan.attention.selection.backend.name == "torch-mla"
    got = [o.token_ids for o in ours.generate(PROMPTS, params)]
    want = [o.token_ids for o in reference.generate(PROMPTS, params)]
    assert got == want


@pytest.mark.parametrize("kind", ["fp8", "fp8-e8m0", "mxfp8"])
def test_quantized_records_keep_bits_per_byte(kind: str, bf16_bits: float) -> None:
    llm = LLM(demo_path(), kv_cache=kind, device="cpu")
    request = llm.plan.attention.request
    assert isinstance(request, AttentionRequest) and request.kv_cache == kind
    assert llm.plan.attention.selection is not None
    assert llm.plan.attention.selection.plugin == "attn_flashmla"
    layout = llm.cache.caches[0]
    assert layout.dtype.itemsize == 1                                 # uint8 record pages
    bits = bits_per_byte(llm.logits, heldout_text()[:HELDOUT_BYTES])
    assert abs(bits - bf16_bits) <= 0.02 * bf16_bits, (kind, bits, bf16_bits)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["bf16", "fp8", "fp8-e8m0", "mxfp8"])
def test_demo_on_gpu_uses_the_triton_kernels(kind: str, bf16_bits: float) -> None:
    llm = LLM(demo_path(), kv_cache=kind, device="cuda")
    assert llm.plan.attention.selection is not None
    assert llm.plan.attention.selection.backend.name == "mla-triton"
    bits = bits_per_byte(llm.logits, heldout_text()[:HELDOUT_BYTES])
    assert abs(bits - bf16_bits) <= 0.02 * bf16_bits, (kind, bits, bf16_bits)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=16))
    assert all(len(o.token_ids) == 16 for o in outputs)
    # decode steps replayed from CUDA graphs: the kernels and the MoE routing capture
    graphs = llm.runner.graphs
    assert graphs is not None and graphs.failed == {} and graphs.replays > 0


@pytest.mark.parametrize("kind", ["bf16", "mxfp8"])
def test_decode_steps_can_be_captured_with_each_record_kind(kind: str) -> None:
    """Decode steps through the engine's CUDA-graph path, captures simulated on the CPU (a
    host read would raise): the records' batched decode reads no length on the host, and
    the tokens are the eager ones."""
    from kernelbay.testing.capture import simulated_graphs

    params = SamplingParams(max_tokens=12)
    want = [o.token_ids for o in LLM(demo_path(), kv_cache=kind, device="cpu",
                                     dtype="float32").generate(PROMPTS, params)]
    llm = LLM(demo_path(), kv_cache=kind, device="cpu", dtype="float32")
    graphs = simulated_graphs(llm)
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == want
    assert graphs.failed == {} and graphs.replays > 5
