"""The dflash2 proposer: verdicts on drafter folders, and the buffers it fills."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kernelbay import ProposerRequest, parse_device
from kernelbay.layers import DraftBuffers
from kernelbay.layers.proposer import DraftContext
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


def _context(hidden: torch.Tensor, have: list[int], lengths: list[int],
             temperature: float = 0.0) -> DraftContext:
    batch = len(lengths)
    return DraftContext(torch.tensor([n - 1 for n in lengths]),
                        torch.full((batch,), temperature), torch.arange(batch) + 7,
                        hidden, torch.tensor(have))


def test_propose_fills_the_core_buffers(drafter_dir: str) -> None:
    proposer = DFlash2Proposer(_request(drafter_dir))
    spec = proposer.draft_logits_spec()
    assert (spec.kind, spec.num_candidates) == ("topc", 5)
    assert proposer.target_layer_ids == (0, 2)
    hidden_spec = proposer.hidden_state_spec()
    assert (hidden_spec.layers, hidden_spec.window) == ((0, 2), 4)
    out = DraftBuffers.allocate(spec, 4, 4, 64)
    gen = torch.Generator().manual_seed(1)
    tokens = [torch.tensor([5, 9, 3]), torch.tensor([4]), torch.tensor([1, 2, 3, 4, 5, 6, 7])]
    hidden = torch.randn(3, 4, 2, 16, generator=gen)
    proposer.propose(tokens, out, _context(hidden, [2, 0, 4], [3, 1, 7]))
    assert out.num_drafted.tolist() == [4, 0, 4, 0]
    assert out.candidate_ids is not None and out.candidate_probs is not None
    assert out.tokens[1].tolist() == [0, 0, 0, 0]
    # Same drafts as the drafter itself on the valid rows of the window.
    for b, have in ((0, 2), (2, 4)):
        context = hidden[b, 4 - have:].flatten(-2)
        expected = proposer.drafter.draft(tokens[b][-1:], context[None], num_tokens=4)
        assert torch.equal(out.tokens[b], expected.tokens[0])
        assert torch.equal(out.candidate_ids[b], expected.candidate_ids[0])
        assert torch.equal(out.candidate_probs[b], expected.candidate_probs[0])


def test_propose_samples_with_the_verifiers_noise(drafter_dir: str) -> None:
    """At temperature > 0 each slot is the argmax of log q + the noise the verifier adds at
    that position, keyed by seed and token id: same seed, same draft; the draft tokens
    are candidates and the conditionals are distributions."""
    proposer = DFlash2Proposer(_request(drafter_dir))
    hidden = torch.randn(2, 4, 2, 16, generator=torch.Generator().manual_seed(2))
    tokens = [torch.tensor([1, 2]), torch.tensor([3, 4, 5])]
    drafts = []
    for _ in range(2):
        out = DraftBuffers.allocate(proposer.draft_logits_spec(), 2, 4, 64)
        proposer.propose(tokens, out, _context(hidden, [1, 2], [2, 3], temperature=1.0))
        drafts.append(out.tokens.clone())
        assert out.candidate_probs is not None and out.candidate_ids is not None
        torch.testing.assert_close(out.candidate_probs.sum(-1), torch.ones(2, 4))
        assert bool((out.candidate_ids == out.tokens[..., None]).any(-1).all())
    assert torch.equal(drafts[0], drafts[1])
    # Reproduce slot 0 of request 0 by hand: argmax of log q + gumbel(seed 7, position 2, id).
    from kernelbay.engine.sampling import gumbel_noise

    ids = out.candidate_ids[0, 0]
    g = gumbel_noise(torch.tensor(7), torch.tensor(2), ids).float()
    best = (out.candidate_probs[0, 0].log() + g).argmax()
    assert int(ids[best]) == int(out.tokens[0, 0])


def test_propose_checks_its_inputs(drafter_dir: str) -> None:
    proposer = DFlash2Proposer(_request(drafter_dir))
    out = DraftBuffers.allocate(proposer.draft_logits_spec(), 2, 4, 64)
    with pytest.raises(ValueError, match="needs a DraftContext"):
        proposer.propose([torch.tensor([1])], out)
    with pytest.raises(ValueError, match=r"expected \[1, window, 2, 16\]"):
        proposer.propose([torch.tensor([1])], out,
                         _context(torch.zeros(1, 4, 2, 15), [1], [1]))
    with pytest.raises(ValueError, match="no drafter weights given"):
        DFlash2Proposer(_request(None))
