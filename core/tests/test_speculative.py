"""Speculative decoding is lossless: the same tokens as plain decoding, greedy and sampled."""

from __future__ import annotations

import pytest
import torch
from kernelbay import NoBackendError, Policy, Registry
from kernelbay.demo import demo_path, heldout_text
from kernelbay.engine import LLM, SamplingParams, SpeculativeConfig

CORE_ONLY = Registry(Policy(plugins=frozenset()))


def _prompts(llm: LLM, count: int) -> list[list[int]]:
    # Windows of held-out code: realistic prompts, several with repeats n-gram lookup can use.
    text = heldout_text()
    gen = torch.Generator().manual_seed(0)
    starts = torch.randint(0, len(text) - 400, (count,), generator=gen).tolist()
    return [llm.encode(text[s:s + int(40 + (s % 160))]) for s in starts]


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM(demo_path(), dtype="float32", registry=CORE_ONLY, max_num_seqs=20)


@pytest.fixture(scope="module")
def speculative() -> LLM:
    return LLM(demo_path(), dtype="float32", registry=CORE_ONLY, max_num_seqs=20,
               speculative=SpeculativeConfig("ngram", 8))


def test_greedy_20_prompts_x_128_tokens_identical(plain: LLM, speculative: LLM) -> None:
    prompts = _prompts(plain, 20)
    params = SamplingParams(max_tokens=128, ignore_eos=True)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    outputs = speculative.generate(prompts, params)
    assert [o.token_ids for o in outputs] == expected
    steps = sum(o.steps for o in outputs)
    assert sum(len(o.token_ids) for o in outputs) / steps > 1.2  # drafts were accepted
    assert speculative.plan.proposer is not None
    assert speculative.plan.proposer.chosen == "ngram"


def test_sampled_with_seeds_identical(plain: LLM, speculative: LLM) -> None:
    prompts = _prompts(plain, 8)
    params = [SamplingParams(max_tokens=96, temperature=0.8, seed=s, ignore_eos=True,
                             top_p=0.95 if s % 2 else 1.0) for s in range(8)]
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in speculative.generate(prompts, params)] == expected


def test_stop_tokens_and_max_tokens_inside_accepted_drafts(plain: LLM,
                                                           speculative: LLM) -> None:
    prompt = plain.encode("import os\nimport sys\nimport os\nimport sys\nimport os\n")
    free = plain.generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    stop = free.token_ids[10]
    for params in (SamplingParams(max_tokens=40, stop_token_ids=(stop,)),
                   SamplingParams(max_tokens=7, ignore_eos=True)):
        want = plain.generate([prompt], params)[0]
        got = speculative.generate([prompt], params)[0]
        assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason)
        assert len(got.step_times) == len(got.token_ids)


def test_unknown_method_is_a_selection_error() -> None:
    with pytest.raises(NoBackendError, match="no proposer accepts eagle"):
        LLM(demo_path(), registry=CORE_ONLY, speculative=SpeculativeConfig("eagle", 4))
