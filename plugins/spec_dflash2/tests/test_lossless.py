"""Speculative decoding with dflash2 gives exactly the tokens of plain decoding, whatever the
drafter: a randomly initialised drafter here (the trained one when it is installed, too)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from kernelbay import Policy, Registry
from kernelbay.demo import demo_path, heldout_windows
from kernelbay.engine import LLM, SamplingParams, SpeculativeConfig
from kernelbay_spec_dflash2.config import DFlash2Config
from kernelbay_spec_dflash2.drafter import DFlash2Drafter, save_drafter
from kernelbay_spec_dflash2.proposer import BUNDLED_DIR

WITH_PLUGIN = Registry.discover(Policy(plugins=frozenset({"spec_dflash2"})))
CORE_ONLY = Registry(Policy(plugins=frozenset()))
TRAINED = os.path.join(BUNDLED_DIR, "demo")


def _prompts(llm: LLM, count: int) -> list[list[int]]:
    return [llm.encode(t) for t in heldout_windows(count, seed=0, shortest=40, spread=160)]


@pytest.fixture(scope="module")
def random_drafter(tmp_path_factory: pytest.TempPathFactory) -> str:
    torch.manual_seed(0)
    config = DFlash2Config(target_model_type="deepseek_v3", target_hidden_size=256,
                           vocab_size=288, target_layer_ids=(1, 3, 4), hidden_size=64,
                           num_layers=1, num_heads=2, intermediate_size=64, block_size=8,
                           conv_groups=4, context_window=16)
    model = DFlash2Drafter(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return save_drafter(model, str(tmp_path_factory.mktemp("drafter") / "d"))


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM(demo_path(), dtype="float32", registry=CORE_ONLY, max_num_seqs=20)


def _speculative(folder: str | None) -> LLM:
    return LLM(demo_path(), dtype="float32", registry=WITH_PLUGIN, max_num_seqs=20,
               speculative=SpeculativeConfig("dflash2", 8, drafter=folder))


def _check(plain: LLM, spec: LLM) -> float:
    prompts = _prompts(plain, 20)
    greedy = SamplingParams(max_tokens=128, ignore_eos=True)
    want = [o.token_ids for o in plain.generate(prompts, greedy)]
    got = spec.generate(prompts, greedy)
    assert [o.token_ids for o in got] == want
    sampled = [SamplingParams(max_tokens=128, temperature=0.8, seed=s, ignore_eos=True,
                              top_p=0.95 if s % 3 == 1 else 1.0) for s in range(20)]
    want = [o.token_ids for o in plain.generate(prompts, sampled)]
    assert [o.token_ids for o in spec.generate(prompts, sampled)] == want
    return sum(len(o.token_ids) for o in got) / sum(o.steps for o in got)


def test_random_drafter_is_lossless(plain: LLM, random_drafter: str) -> None:
    spec = _speculative(random_drafter)
    assert spec.plan.proposer is not None and spec.plan.proposer.chosen == "dflash2"
    _check(plain, spec)


@pytest.mark.skipif(not os.path.isfile(os.path.join(TRAINED, "model.safetensors")),
                    reason="the trained demo drafter is not installed")
def test_trained_drafter_is_lossless_and_accepts(plain: LLM) -> None:
    tau = _check(plain, _speculative(None))
    assert tau > 1.5  # a random drafter gets about 1.0


def test_hidden_states_reach_the_drafter(plain: LLM, random_drafter: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The window propose() sees equals the target's own states at the declared layers."""
    spec = _speculative(random_drafter)
    proposer = spec.proposer
    assert proposer is not None
    seen: list[tuple[list[int], torch.Tensor, int]] = []
    original = proposer.propose

    def spy(token_ids, out, context=None):  # type: ignore[no-untyped-def]
        assert context is not None and context.hidden_states is not None
        assert context.num_hidden is not None
        seen.append((token_ids[0].tolist(), context.hidden_states[0].clone(),
                     int(context.num_hidden[0])))
        original(token_ids, out, context)

    monkeypatch.setattr(proposer, "propose", spy)
    prompt = _prompts(plain, 1)[0]
    spec.generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True))
    assert seen[0][2] == 0  # nothing has been through the target before the first step
    model = plain.model
    for tokens, window, have in seen[1:]:
        cached = len(tokens) - 1
        seq = [int(t) for t in tokens[:cached]]
        from kernelbay.engine.kv_cache import pages_for
        from kernelbay.engine.runner import Sequence

        s = Sequence(-1, seq, len(seq), SamplingParams())
        s.pages = plain.cache.allocator.allocate(pages_for(len(seq), plain.cache.page_size))
        try:
            plain.runner.forward([(s, len(seq))], all_logits=True, capture=(1, 3, 4))
        finally:
            plain.cache.allocator.free(s.pages)
        full = plain.runner.captured
        assert full is not None
        assert have == min(16, cached)
        torch.testing.assert_close(window[16 - have:], full[cached - have:], rtol=1e-4,
                                   atol=1e-4)
    del model


def test_missing_bundled_weights_are_named(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import kernelbay_spec_dflash2.proposer as proposer_module
    from kernelbay import NoBackendError

    monkeypatch.setattr(proposer_module, "BUNDLED_DIR", str(tmp_path))
    fresh = Registry.discover(Policy(plugins=frozenset({"spec_dflash2"})))  # no cached verdicts
    with pytest.raises(NoBackendError, match="bundled drafter for the kernelbay demo model is "
                       "missing") as info:
        LLM(demo_path(), dtype="float32", registry=fresh,
            speculative=SpeculativeConfig("dflash2", 8))
    assert "model.safetensors" in str(info.value)
    assert "tools/train_drafter.py" in str(info.value).replace("\n", "").replace(" ", "")
