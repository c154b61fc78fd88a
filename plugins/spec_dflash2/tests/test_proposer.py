"""The dflash2 proposer: verdicts on drafter folders, and the buffers it fills."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kernelbay import ProposerRequest, parse_device
from kernelbay.layers import DraftBuffers
from kernelbay_spec_dflash2.config import DFlash2Config
from kernelbay_spec_dflash2.drafter import DFlash2Drafter, save_drafter
from kernelbay_spec_dflash2.proposer import DFlash2Proposer

CPU = parse_device("cpu")
CONFIG = DFlash2Config(target_model_type="llama", target_hidden_size=16, vocab_size=64,
                       target_layer_ids=(0, 2), hidden_size=32, num_heads=2,
                       intermediate_size=32, block_size=6, num_candidates=5, pair_rank=4,
                       conv_groups=4, context_window=4)


@pytest.fixture
def drafter_dir(tmp_path: Path) -> str:
    torch.manual_seed(0)
    model = DFlash2Drafter(CONFIG)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return save_drafter(model, str(tmp_path / "drafter"))


def _request(folder: str | None, **kw: object) -> ProposerRequest:
    args: dict[str, object] = dict(method="dflash2", num_speculative_tokens=4, vocab_size=64,
                                   model_type="llama", hidden_size=16, drafter=folder)
    args.update(kw)
    return ProposerRequest(**args)  # type: ignore[arg-type]


def test_accepts_a_matching_drafter(drafter_dir: str) -> None:
    assert DFlash2Proposer.can_implement(_request(drafter_dir), CPU)
    assert DFlash2Proposer.can_implement(_request(drafter_dir), parse_device("sm_90"))


@pytest.mark.parametrize("change, words", [
    ({"model_type": "qwen2"}, ["'llama'", "'qwen2'"]),
    ({"hidden_size": 4096}, ["16", "4096"]),
    ({"vocab_size": 65}, ["64", "65"]),
    ({"num_speculative_tokens": 7}, ["6", "7"]),
    ({"method": "ngram"}, ["'dflash2'", "'ngram'"]),
])
def test_rejects_mismatches_with_both_values(drafter_dir: str, change: dict[str, object],
                                             words: list[str]) -> None:
    verdict = DFlash2Proposer.can_implement(_request(drafter_dir, **change), CPU)
    assert not verdict
    for word in words:
        assert word in verdict.reason, verdict.reason


def test_rejects_missing_drafters(tmp_path: Path) -> None:
    verdict = DFlash2Proposer.can_implement(_request(None), CPU)
    assert not verdict and verdict.reason.startswith("no drafter weights given")
    verdict = DFlash2Proposer.can_implement(_request(str(tmp_path / "nope")), CPU)
    assert not verdict and "does not exist" in verdict.reason
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text(CONFIG.to_json())
    verdict = DFlash2Proposer.can_implement(_request(str(tmp_path / "half")), CPU)
    assert not verdict and "['model.safetensors']" in verdict.reason
    (tmp_path / "half" / "model.safetensors").write_bytes(b"")
    (tmp_path / "half" / "config.json").write_text("{not json")
    verdict = DFlash2Proposer.can_implement(_request(str(tmp_path / "half")), CPU)
    assert not verdict and "not valid JSON" in verdict.reason


def test_propose_fills_the_core_buffers(drafter_dir: str) -> None:
    proposer = DFlash2Proposer(_request(drafter_dir))
    spec = proposer.draft_logits_spec()
    assert (spec.kind, spec.num_candidates) == ("topc", 5)
    assert proposer.target_layer_ids == (0, 2)
    out = DraftBuffers.allocate(spec, 3, 4, 64)
    gen = torch.Generator().manual_seed(1)
    tokens = [torch.tensor([5, 9, 3]), torch.tensor([], dtype=torch.long),
              torch.tensor([1, 2, 3, 4, 5, 6, 7])]
    hidden = [torch.randn(3, 2, 16, generator=gen), torch.randn(0, 2, 16),
              torch.randn(7, 32, generator=gen)]
    proposer.set_context(hidden)
    proposer.propose(tokens, out)
    assert out.num_drafted.tolist() == [4, 0, 4]
    assert out.candidate_ids is not None and out.candidate_probs is not None
    assert out.tokens[1].tolist() == [0, 0, 0, 0]
    # Same drafts as the drafter itself on the trimmed, right-aligned context.
    for b in (0, 2):
        context = hidden[b].flatten(-2) if hidden[b].dim() == 3 else hidden[b]
        expected = proposer.drafter.draft(tokens[b][-1:], context[-4:][None], num_tokens=4)
        assert torch.equal(out.tokens[b], expected.tokens[0])
        assert torch.equal(out.candidate_ids[b], expected.candidate_ids[0])
        assert torch.equal(out.candidate_probs[b], expected.candidate_probs[0])
    # The context is consumed: a second propose without set_context is an error.
    with pytest.raises(RuntimeError, match="set_context"):
        proposer.propose(tokens, out)


def test_propose_samples_at_temperature(drafter_dir: str) -> None:
    proposer = DFlash2Proposer(_request(drafter_dir), temperature=1.0, seed=3)
    out = DraftBuffers.allocate(proposer.draft_logits_spec(), 1, 4, 64)
    proposer.set_context([torch.randn(2, 32, generator=torch.Generator().manual_seed(2))])
    proposer.propose([torch.tensor([1, 2])], out)
    assert out.candidate_probs is not None and out.candidate_ids is not None
    torch.testing.assert_close(out.candidate_probs[0].sum(-1), torch.ones(4))
    assert bool((out.candidate_ids[0] == out.tokens[0][:, None]).any(-1).all())


def test_propose_checks_its_inputs(drafter_dir: str) -> None:
    proposer = DFlash2Proposer(_request(drafter_dir))
    with pytest.raises(ValueError, match=r"expected \[L, 2, 16\] or \[L, 32\]"):
        proposer.set_context([torch.zeros(3, 31)])
    out = DraftBuffers.allocate(proposer.draft_logits_spec(), 2, 4, 64)
    proposer.set_context([torch.zeros(3, 32)])
    with pytest.raises(ValueError, match="set_context got 1 requests, propose got 2"):
        proposer.propose([torch.tensor([1]), torch.tensor([2])], out)
    with pytest.raises(ValueError, match="no drafter weights given"):
        DFlash2Proposer(_request(None))
