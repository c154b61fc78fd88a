"""Speculative decoding is lossless: the same tokens as plain decoding, greedy and sampled."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch
from kernelbay import NoBackendError, Policy, ProposerRequest, Registry, Verdict, hookimpl
from kernelbay.demo import demo_path, heldout_windows
from kernelbay.engine import LLM, SamplingParams, SpeculativeConfig
from kernelbay.layers import DraftBuffers, DraftLogitsSpec, Proposer
from kernelbay.layers.proposer import DraftContext, HiddenStateSpec

CORE_ONLY = Registry(Policy(plugins=frozenset()))


def _prompts(llm: LLM, count: int) -> list[list[int]]:
    # Windows of held-out code: realistic prompts, several with repeats n-gram lookup can use.
    return [llm.encode(t) for t in heldout_windows(count, seed=0, shortest=40, spread=160)]


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
    prompts = _prompts(plain, 20)
    params = [SamplingParams(max_tokens=128, temperature=0.8, seed=s, ignore_eos=True,
                             top_p=0.95 if s % 2 else 1.0) for s in range(20)]
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


class _Recorder(Proposer):
    """Declares hidden states, drafts the last token twice, and records every context."""

    name = "test-recorder"
    api_version = "1.0"
    summary = "records its DraftContext"
    seen: ClassVar[list[tuple[list[int], DraftContext]]] = []

    @classmethod
    def can_implement(cls, request: ProposerRequest, device: Any) -> Verdict:
        return Verdict.handles(request.method == "record", "method 'record'")

    def draft_logits_spec(self) -> DraftLogitsSpec:
        return DraftLogitsSpec("topc", 1)

    def hidden_state_spec(self) -> HiddenStateSpec:
        return HiddenStateSpec((0, -1, 2), 6)

    def propose(self, token_ids: Any, out: DraftBuffers,
                context: DraftContext | None = None) -> None:
        assert context is not None and context.hidden_states is not None
        assert context.num_hidden is not None
        self.seen.append((token_ids[0].tolist(),
                          DraftContext(context.num_cached.clone(), context.temperature.clone(),
                                       context.seed.clone(), context.hidden_states.clone(),
                                       context.num_hidden.clone())))
        for b, tokens in enumerate(token_ids):
            out.tokens[b] = tokens[-1]
            out.num_drafted[b] = 2


class _RecorderPlugin:
    KERNELBAY_PLUGIN_API = "1.0"

    @hookimpl
    def kernelbay_proposers(self) -> list[type[Proposer]]:
        return [_Recorder]


def test_declared_hidden_states_are_captured_for_accepted_positions(plain: LLM) -> None:
    registry = Registry(Policy(plugins=frozenset()))
    registry.register(_RecorderPlugin(), "recorder")
    llm = LLM(demo_path(), dtype="float32", registry=registry, max_num_seqs=3,
              speculative=SpeculativeConfig("record", 2))
    assert llm.speculator.layers == (0, 4, 2)
    _Recorder.seen.clear()
    prompts = [plain.encode("    def __init__(self):\n        self.x = 1\n"),
               plain.encode("import os\n")]
    params = [SamplingParams(max_tokens=30, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0.5, seed=11, ignore_eos=True)]
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate(prompts, params)]
    first = _Recorder.seen[0][1]
    assert first.num_hidden is not None and first.num_hidden.tolist() == [0, 0]
    assert first.temperature.tolist() == [0.0, 0.5] and first.seed.tolist() == [0, 11]
    for tokens, context in _Recorder.seen[1:]:
        cached = int(context.num_cached[0])
        assert cached == len(tokens) - 1
        from kernelbay.engine.kv_cache import pages_for
        from kernelbay.engine.runner import Sequence

        seq = Sequence(-1, tokens[:cached], cached, SamplingParams())
        seq.pages = plain.cache.allocator.allocate(pages_for(cached, plain.cache.page_size))
        try:
            plain.runner.forward([(seq, cached)], all_logits=True, capture=(0, 4, 2))
        finally:
            plain.cache.allocator.free(seq.pages)
        full = plain.runner.captured
        assert full is not None and context.hidden_states is not None
        assert context.num_hidden is not None
        have = int(context.num_hidden[0])
        assert have == min(6, cached)
        torch.testing.assert_close(context.hidden_states[0, 6 - have:], full[cached - have:],
                                   rtol=1e-4, atol=1e-4)


def test_hidden_state_spec_resolves_against_the_depth() -> None:
    assert HiddenStateSpec((0, -1, 2), 4).resolve(4) == (0, 4, 2)
    assert HiddenStateSpec((-5,), 1).resolve(4) == (0,)
    with pytest.raises(ValueError, match=r"\[5\] out of range for a target of 4 layers"):
        HiddenStateSpec((1, 5), 4).resolve(4)
    with pytest.raises(ValueError, match="window must be >= 1"):
        HiddenStateSpec((1,), 0)
    with pytest.raises(ValueError, match="at least one layer"):
        HiddenStateSpec((), 3)
