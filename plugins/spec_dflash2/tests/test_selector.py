"""CandidateSelector: Viterbi against brute force; the sampling distribution it reports."""

from __future__ import annotations

import itertools

import pytest
import torch
from kernelbay_spec_dflash2.modules import CandidateSelector


def _setup(vocab: int, c: int, k: int, rank: int, batch: int, seed: int
           ) -> tuple[CandidateSelector, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    sel = CandidateSelector(vocab, c, rank)
    with torch.no_grad():
        sel.pair_u.weight.copy_(torch.randn(vocab, rank, generator=gen))
        sel.pair_v.weight.copy_(torch.randn(vocab, rank, generator=gen))
        sel.unigram_weight.fill_(0.7)
    logits = torch.randn(batch, k, vocab, generator=gen) * 3
    anchor = torch.randint(0, vocab, (batch,), generator=gen)
    return sel, logits, anchor


def _brute_force(sel: CandidateSelector, logits: torch.Tensor, anchor: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, list[list[list[int]]]]:
    """S(path) of every path of every batch row, straight from the definition (float64)."""
    logp = torch.log_softmax(logits.double(), -1)
    u, v = sel.pair_u.weight.detach().double(), sel.pair_v.weight.detach().double()
    w = sel.unigram_weight.detach().double()
    ids = logp.topk(sel.num_candidates, -1).indices
    all_scores, all_paths = [], []
    for b in range(logits.shape[0]):
        scores, paths = [], []
        for choice in itertools.product(range(sel.num_candidates), repeat=logits.shape[1]):
            tokens = [int(ids[b, t, j]) for t, j in enumerate(choice)]
            prev, s = int(anchor[b]), 0.0
            for t, tok in enumerate(tokens):
                s += float(w * logp[b, t, tok] + u[prev] @ v[tok])
                prev = tok
            scores.append(s)
            paths.append(tokens)
        all_scores.append(scores)
        all_paths.append(paths)
    return torch.tensor(all_scores, dtype=torch.float64), ids, all_paths


@pytest.mark.parametrize("c, k", [(1, 4), (2, 1), (3, 3), (4, 4), (5, 2)])
def test_viterbi_equals_brute_force(c: int, k: int) -> None:
    sel, logits, anchor = _setup(vocab=23, c=c, k=k, rank=3, batch=4, seed=10 * c + k)
    out = sel(logits, anchor)
    scores, _, paths = _brute_force(sel, logits, anchor)
    for b in range(logits.shape[0]):
        best = int(scores[b].argmax())
        assert out.tokens[b].tolist() == paths[b][best]
        torch.testing.assert_close(out.scores[b].double(), scores[b, best], rtol=1e-5,
                                   atol=1e-5)
    # The greedy draft distribution is the point mass on the chosen path.
    assert torch.equal(out.candidate_probs.sum(-1), torch.ones(4, k))
    assert torch.equal(out.candidate_probs.gather(-1, out.choice[..., None]).squeeze(-1),
                       torch.ones(4, k))
    assert torch.equal(out.candidate_ids.gather(-1, out.choice[..., None]).squeeze(-1),
                       out.tokens)


def test_pair_term_changes_the_path() -> None:
    # With the unigram term switched off, the path follows the pair term alone, so it must
    # differ from the per-slot argmax somewhere (the test fails if pairs are ignored).
    sel, logits, anchor = _setup(vocab=31, c=4, k=4, rank=4, batch=8, seed=5)
    with torch.no_grad():
        sel.unigram_weight.zero_()
    out = sel(logits, anchor)
    assert not torch.equal(out.tokens, logits.argmax(-1))


@pytest.mark.parametrize("temperature", [0.3, 1.0, 4.0])
def test_sampling_conditionals_are_the_lattice_distribution(temperature: float) -> None:
    """q(y_t | y_<t) sums to one, and for every path y the product of the conditionals along
    it equals exp(S(y)/T) / Z computed by enumeration: the distribution sampled from is the
    Gibbs distribution of S over the candidate lattice."""
    c, k = 3, 3
    sel, logits, anchor = _setup(vocab=19, c=c, k=k, rank=2, batch=3, seed=int(temperature * 10))
    scores, ids, paths = _brute_force(sel, logits, anchor)
    joint = torch.softmax(scores / temperature, dim=-1)                 # [B, c^k]
    gen = torch.Generator().manual_seed(0)
    for _ in range(40):
        out = sel(logits, anchor, temperature=temperature, generator=gen)
        torch.testing.assert_close(out.candidate_probs.sum(-1), torch.ones(3, k))
        assert torch.equal(out.candidate_ids, ids)
        for b in range(3):
            # The prefix-conditionals of the sampled path, multiplied, give its joint mass.
            q = out.candidate_probs[b].gather(-1, out.choice[b, :, None]).prod().double()
            index = paths[b].index(out.tokens[b].tolist())
            torch.testing.assert_close(q, joint[b, index], rtol=1e-4, atol=1e-6)
    # Slot-0 marginal equals the joint summed over the rest.
    out = sel(logits, anchor, temperature=temperature, generator=gen)
    slot0 = joint.view(3, c, c ** (k - 1)).sum(-1)
    torch.testing.assert_close(out.candidate_probs[:, 0].double(), slot0, rtol=1e-4, atol=1e-6)


def test_sampling_frequencies_follow_the_distribution() -> None:
    sel, logits, anchor = _setup(vocab=11, c=2, k=2, rank=2, batch=1, seed=3)
    scores, _, paths = _brute_force(sel, logits, anchor)
    joint = torch.softmax(scores[0] / 1.0, dim=-1)
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(4, dtype=torch.float64)
    n = 4000
    for _ in range(n):
        out = sel(logits, anchor, temperature=1.0, generator=gen)
        counts[paths[0].index(out.tokens[0].tolist())] += 1
    # 5 standard deviations of a binomial proportion: a wrong distribution fails, noise does not.
    tol = 5 * torch.sqrt(joint * (1 - joint) / n) + 1e-3
    assert torch.all((counts / n - joint).abs() <= tol), (counts / n, joint)


def test_selector_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError, match=r"num_candidates must be in \[1, vocab_size=5\], got 6"):
        CandidateSelector(5, 6)
    sel = CandidateSelector(10, 3, 2)
    with pytest.raises(ValueError, match="expected logits"):
        sel(torch.zeros(2, 4, 9), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        sel(torch.zeros(2, 4, 10), torch.zeros(2, dtype=torch.long), temperature=-1.0)
