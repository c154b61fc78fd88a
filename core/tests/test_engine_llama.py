"""The engine against transformers on tiny random Llama, Mistral and Qwen2 checkpoints."""

from __future__ import annotations

import os

import pytest
import torch
from engine_helpers import greedy_reference, reference, save_tiny
from kernelbay import Policy, Registry
from kernelbay.engine import LLM, SamplingParams

CORE_ONLY = Registry(Policy(plugins=frozenset()))
PROMPT = [1, 17, 42, 99, 5, 5, 63, 120, 7]


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    family = request.param
    extra = {"tie_word_embeddings": True} if family == "qwen2" else {}
    return save_tiny(str(tmp_path_factory.mktemp(family)), family, **extra)


def test_fp32_logits_match_transformers(checkpoint: str) -> None:
    llm = LLM(checkpoint, device="cpu", dtype="float32", registry=CORE_ONLY)
    ours = llm.logits(PROMPT)
    with torch.no_grad():
        theirs = reference(checkpoint)(torch.tensor([PROMPT])).logits[0]
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_32_greedy_tokens_match_transformers(checkpoint: str) -> None:
    llm = LLM(checkpoint, device="cpu", dtype="float32", registry=CORE_ONLY)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=32, ignore_eos=True))[0]
    assert out.token_ids == greedy_reference(reference(checkpoint), PROMPT, 32)
    assert out.finish_reason == "length" and len(out.step_times) == 32


def test_bf16_logits_within_tolerance(checkpoint: str) -> None:
    # bf16 keeps 8 mantissa bits; through two layers the logits agree to ~2^-6 relative to
    # their spread. Stated tolerance: max |diff| <= 3% of the reference's max |logit|.
    llm = LLM(checkpoint, device="cpu", dtype="bfloat16", registry=CORE_ONLY)
    ours = llm.logits(PROMPT)
    with torch.no_grad():
        theirs = reference(checkpoint, torch.bfloat16)(torch.tensor([PROMPT])).logits[0].float()
    assert (ours - theirs).abs().max() <= 0.03 * theirs.abs().max()


def test_batched_generation_equals_one_at_a_time(checkpoint: str) -> None:
    llm = LLM(checkpoint, dtype="float32", registry=CORE_ONLY, max_num_seqs=8)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 160, (n,), generator=gen).tolist()
               for n in (1, 2, 5, 9, 16, 17, 33, 40)]
    params = [SamplingParams(max_tokens=12, ignore_eos=True)] * 4 + [
        SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.9, seed=s, top_k=k,
                       top_p=p) for s, k, p in ((1, 0, 1.0), (2, 20, 1.0), (3, 0, 0.8),
                                                (4, 50, 0.9))]
    together = llm.generate(prompts, params)
    alone = [llm.generate([p], [sp])[0] for p, sp in zip(prompts, params, strict=True)]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]


def test_seeded_sampling_is_reproducible_and_seed_dependent(checkpoint: str) -> None:
    llm = LLM(checkpoint, dtype="float32", registry=CORE_ONLY)
    runs = [llm.generate(PROMPT, SamplingParams(max_tokens=20, temperature=1.0, seed=s,
                                                ignore_eos=True))[0].token_ids
            for s in (11, 11, 12)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_stop_tokens_end_a_request(checkpoint: str) -> None:
    llm = LLM(checkpoint, dtype="float32", registry=CORE_ONLY)
    free = llm.generate(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    stop = free[3]
    out = llm.generate(PROMPT, SamplingParams(max_tokens=8, stop_token_ids=(stop,)))[0]
    assert out.token_ids == free[:free.index(stop) + 1] and out.finish_reason == "stop"


def test_plan_lists_every_layer(checkpoint: str) -> None:
    llm = LLM(checkpoint, dtype="float32", registry=CORE_ONLY)
    plan = llm.plan
    assert plan.ok and plan.format.chosen == "unquantized"
    assert {d.chosen for d in plan.linears} == {"torch-unquantized"}
    tied = "lm_head" not in {d.module for d in plan.linears}
    assert tied == (os.path.basename(checkpoint).startswith("qwen2"))


def test_kv_cache_budget_sizes_the_page_pool(checkpoint: str) -> None:
    from kernelbay.engine import KVCacheConfig

    probe = LLM(checkpoint, dtype="float32", registry=CORE_ONLY)
    per_page = probe.cache.page_bytes
    llm = LLM(checkpoint, dtype="float32", registry=CORE_ONLY,
              kv_cache=KVCacheConfig(memory=per_page * 6 + 7, page_size=16))
    assert llm.cache.allocator.num_pages == 5  # and the scratch page
    ok = llm.generate(PROMPT, SamplingParams(max_tokens=16, ignore_eos=True))[0]
    assert len(ok.token_ids) == 16
    with pytest.raises(MemoryError, match="needs 6 KV-cache pages, the cache has 5"):
        llm.generate(PROMPT, SamplingParams(max_tokens=80, ignore_eos=True))
