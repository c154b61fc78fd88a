"""The two DFlash2 building blocks: the dynamic depthwise convolution and the candidate selector.

DynamicDepthwiseConv (two taps, causal, within a block of k slots)::

    y_t = k_{t,0} * x_t + k_{t,1} * x_{t-1},    x_{-1} := 0 at each block's first slot
    k_{t,j}[ch] = static_j[ch] + delta_j(x_t)[group(ch)]

where ``delta`` is a linear map from x_t to one value per tap and channel group.

CandidateSelector (one block, anchor token y_{-1} = a; slot t keeps its top-c tokens)::

    S(y) = sum_t [ w * log p_t(y_t) + U[y_{t-1}] . V[y_t] ]

``log p_t`` is the drafter's log-softmax at slot t (the unigram term), ``U``, ``V`` are
[vocab, r] tables (the low-rank bilinear pair term). Greedy: the path maximising S by exact
Viterbi. Temperature T > 0: a path drawn from p(y) = exp(S(y)/T) / Z over the c^k paths of the
candidate lattice, drawn left to right from its exact conditionals (forward-filtering via
backward messages); those conditionals are what ``candidate_probs`` returns. The draw at each
slot is either ``torch.multinomial`` with a generator, or -- what the speculative engine uses
-- a Gumbel-noised argmax whose noise the caller supplies per candidate (keyed by seed,
position and token id, the same noise the verifier adds to the target's logits).

Candidates are the top-c logits with ties broken towards the lower token id
(``topk_lower_id``), so the lattice is deterministic and equal under tensor parallel
(``kernelbay_spec_dflash2.tp.vocab_parallel_topk``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["CandidateSelector", "DynamicDepthwiseConv", "SelectorOutput", "topk_lower_id"]


def topk_lower_id(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest of ``values`` [..., V] along the last dim, descending, equal values
    ordered by lower index (deterministic, unlike ``torch.topk``'s tie order)."""
    ordered, index = torch.sort(values, dim=-1, descending=True, stable=True)
    return ordered[..., :k], index[..., :k]


class DynamicDepthwiseConv(nn.Module):
    """Two-tap causal depthwise convolution inside blocks of ``block_size`` slots.

    Input ``[..., S, channels]`` with S a multiple of ``block_size``; consecutive runs of
    ``block_size`` slots are independent blocks, and no tap reaches across a block start.
    The kernel is a static per-channel kernel plus a content-dependent delta per channel
    group, computed from the current slot. Initialised to the identity (tap 0 = 1, tap 1 = 0,
    zero delta), so a fresh module passes its input through.
    """

    def __init__(self, channels: int, block_size: int, groups: int = 8) -> None:
        super().__init__()
        if channels % groups:
            raise ValueError(f"channels={channels} is not a multiple of groups={groups}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.channels = channels
        self.block_size = block_size
        self.groups = groups
        self.static = nn.Parameter(torch.stack([torch.ones(channels), torch.zeros(channels)]))
        self.delta = nn.Linear(channels, 2 * groups)
        nn.init.zeros_(self.delta.weight)
        nn.init.zeros_(self.delta.bias)

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        """Per-slot taps ``[..., S, 2, channels]``: static kernel + group deltas from x_t."""
        delta: torch.Tensor = self.delta(x)
        delta = delta.reshape(*x.shape[:-1], 2, self.groups)             # [..., S, 2, G]
        delta = delta.repeat_interleave(self.channels // self.groups, dim=-1)
        return self.static + delta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the convolution; ``x`` is ``[..., S, channels]``."""
        slots = x.shape[-2]
        if x.shape[-1] != self.channels or slots % self.block_size:
            raise ValueError(f"expected [..., S, {self.channels}] with S a multiple of "
                             f"block_size={self.block_size}, got {tuple(x.shape)}")
        blocks = x.reshape(*x.shape[:-2], slots // self.block_size, self.block_size,
                           self.channels)
        # Shift by one slot inside each block; the zero row is x_{-1} at every block start.
        prev = torch.cat([torch.zeros_like(blocks[..., :1, :]), blocks[..., :-1, :]], dim=-2)
        prev = prev.flatten(-3, -2)
        taps = self.kernel(x)
        return taps[..., 0, :] * x + taps[..., 1, :] * prev


@dataclass
class SelectorOutput:
    """What the selector picked for a batch of blocks.

    ``tokens`` [B, k] the chosen path; ``choice`` [B, k] its index among each slot's
    candidates; ``candidate_ids`` [B, k, c] each slot's top-c tokens (by the drafter's
    logits, descending); ``candidate_probs`` [B, k, c] the draft distribution of each slot
    given the chosen prefix (one-hot at the choice when greedy); ``scores`` [B] S(path).
    """

    tokens: torch.Tensor
    choice: torch.Tensor
    candidate_ids: torch.Tensor
    candidate_probs: torch.Tensor
    scores: torch.Tensor


class CandidateSelector(nn.Module):
    """Best (or sampled) path through the top-c candidates of k slots, from an anchor token.

    Scores a path with the drafter's per-slot log-probabilities (weighted by a learned scalar)
    plus a low-rank bilinear pair term ``U[prev] . V[next]`` for each adjacent pair, the
    anchor counting as the token before slot 0. See the module docstring for the exact
    distribution sampled at temperature > 0.
    """

    def __init__(self, vocab_size: int, num_candidates: int = 16, rank: int = 16) -> None:
        super().__init__()
        if not 1 <= num_candidates <= vocab_size:
            raise ValueError(f"num_candidates must be in [1, vocab_size={vocab_size}], "
                             f"got {num_candidates}")
        self.vocab_size = vocab_size
        self.num_candidates = num_candidates
        self.rank = rank
        self.pair_u = nn.Embedding(vocab_size, rank)
        self.pair_v = nn.Embedding(vocab_size, rank)
        nn.init.normal_(self.pair_u.weight, std=rank ** -0.5)
        nn.init.normal_(self.pair_v.weight, std=rank ** -0.5)
        self.unigram_weight = nn.Parameter(torch.ones(()))

    # -- the lattice ---------------------------------------------------------------------

    def candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-c ids ``[B, k, c]`` per slot and their unigram terms ``w * log p_t(id)``."""
        if logits.dim() != 3 or logits.shape[-1] != self.vocab_size:
            raise ValueError(f"expected logits [B, k, {self.vocab_size}], got "
                             f"{tuple(logits.shape)}")
        logp = torch.log_softmax(logits.float(), dim=-1)
        top, ids = topk_lower_id(logp, self.num_candidates)
        return ids, self.unigram_weight.float() * top

    def transitions(self, anchor: torch.Tensor, ids: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pair terms: from the anchor into slot 0 ``[B, c]``, and between slots t-1 and t
        ``[B, k-1, c, c]`` (row = candidate at t-1, column = candidate at t)."""
        u_anchor = self.pair_u(anchor).float()                          # [B, r]
        v = self.pair_v(ids).float()                                    # [B, k, c, r]
        first = torch.einsum("br,bcr->bc", u_anchor, v[:, 0])
        u = self.pair_u(ids[:, :-1]).float()                            # [B, k-1, c, r]
        between = torch.einsum("btir,btjr->btij", u, v[:, 1:])
        return first, between

    # -- selection -----------------------------------------------------------------------

    def forward(self, logits: torch.Tensor, anchor: torch.Tensor, temperature: float = 0.0,
                generator: torch.Generator | None = None) -> SelectorOutput:
        """Select a path for each block: ``logits`` [B, k, vocab], ``anchor`` [B] token ids.

        ``temperature == 0``: the Viterbi path. ``temperature > 0``: a sample from
        ``exp(S/temperature)`` over the lattice, drawn with ``generator``.
        """
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        ids, unigram, first, between = self._lattice(logits, anchor)
        if temperature == 0:
            choice, scores = _viterbi(unigram, first, between)
            probs = torch.zeros_like(unigram).scatter_(-1, choice[..., None], 1.0)
        else:
            inv = torch.full(unigram.shape[:1], 1.0 / temperature, device=unigram.device)
            choice, probs = _sample(unigram, first, between, inv, generator, None)
            scores = path_scores(unigram, first, between, choice)
        tokens = ids.gather(-1, choice[..., None]).squeeze(-1)
        return SelectorOutput(tokens, choice, ids, probs, scores)

    def select_keyed(self, logits: torch.Tensor, anchor: torch.Tensor,
                     temperature: torch.Tensor, noise: Callable[[torch.Tensor], torch.Tensor]
                     ) -> SelectorOutput:
        """Per-row temperature [B]: rows at 0 take the Viterbi path, the others draw each
        slot as ``argmax(log q(y_t | anchor, y_<t) + g)`` where ``g = noise(candidate_ids)``
        [B, k, c] is Gumbel noise keyed by the caller (seed, position, token id)."""
        ids, unigram, first, between = self._lattice(logits, anchor)
        choice, scores = _viterbi(unigram, first, between)
        probs = torch.zeros_like(unigram).scatter_(-1, choice[..., None], 1.0)
        hot = temperature.to(unigram.device) > 0
        if bool(hot.any()):
            inv = 1.0 / temperature.to(unigram.device).float().clamp(min=1e-6)
            sampled, sampled_probs = _sample(unigram, first, between, inv, None,
                                             noise(ids).to(unigram.dtype))
            choice = torch.where(hot[:, None], sampled, choice)
            probs = torch.where(hot[:, None, None], sampled_probs, probs)
            scores = path_scores(unigram, first, between, choice)
        tokens = ids.gather(-1, choice[..., None]).squeeze(-1)
        return SelectorOutput(tokens, choice, ids, probs, scores)

    def _lattice(self, logits: torch.Tensor, anchor: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        ids, unigram = self.candidates(logits)
        anchor = anchor.to(ids.device).long()
        if anchor.shape != ids.shape[:1]:
            raise ValueError(f"expected anchor [{ids.shape[0]}], got {tuple(anchor.shape)}")
        first, between = self.transitions(anchor, ids)
        return ids, unigram, first, between

    def log_partition(self, logits: torch.Tensor, anchor: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                 torch.Tensor]:
        """For training: candidate ids, unigram, pair terms and log Z [B] of the lattice
        (``logsumexp`` of S over all c^k paths, by the forward algorithm)."""
        ids, unigram, first, between = self._lattice(logits, anchor)
        alpha = first + unigram[:, 0]
        for t in range(1, unigram.shape[1]):
            alpha = torch.logsumexp(alpha[:, :, None] + between[:, t - 1], dim=1) + unigram[:, t]
        return ids, unigram, first, between, torch.logsumexp(alpha, dim=-1)


def path_scores(unigram: torch.Tensor, first: torch.Tensor, between: torch.Tensor,
                choice: torch.Tensor) -> torch.Tensor:
    """S of the paths given by candidate indices ``choice`` [B, k] (for checks and reports)."""
    score = unigram.gather(-1, choice[..., None]).squeeze(-1).sum(-1)
    score = score + first.gather(-1, choice[:, :1]).squeeze(-1)
    if between.shape[1]:
        rows = between.gather(2, choice[:, :-1, None, None].expand(-1, -1, 1, between.shape[-1]))
        score = score + rows.squeeze(2).gather(-1, choice[:, 1:, None]).squeeze(-1).sum(-1)
    return score


def _viterbi(unigram: torch.Tensor, first: torch.Tensor, between: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    # best[b, j]: the best score of a path ending in candidate j of the current slot.
    best = first + unigram[:, 0]
    back = []
    for t in range(1, unigram.shape[1]):
        total = best[:, :, None] + between[:, t - 1]                  # [B, c_prev, c]
        best, arg = total.max(dim=1)
        best = best + unigram[:, t]
        back.append(arg)
    score, last = best.max(dim=-1)
    path = [last]
    for arg in reversed(back):
        path.append(arg.gather(-1, path[-1][:, None]).squeeze(-1))
    return torch.stack(path[::-1], dim=1), score


def _sample(unigram: torch.Tensor, first: torch.Tensor, between: torch.Tensor,
            inv_temperature: torch.Tensor, generator: torch.Generator | None,
            gumbel: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    # gumbel [B, k, c]: draw by noised argmax; None: draw with multinomial(generator).
    batch, k, c = unigram.shape
    inv = inv_temperature.to(unigram.dtype)[:, None]
    # beta[t][b, j] = log sum over completions of slots t+1.. of exp(S_rest / T) given slot t = j.
    beta = [torch.zeros(batch, c, dtype=unigram.dtype, device=unigram.device)]
    for t in range(k - 1, 0, -1):
        nxt = (between[:, t - 1] + unigram[:, t, None, :]) * inv[..., None] + beta[0][:, None, :]
        beta.insert(0, torch.logsumexp(nxt, dim=-1))
    choice = torch.empty(batch, k, dtype=torch.long, device=unigram.device)
    probs = torch.empty_like(unigram)
    step = (first + unigram[:, 0]) * inv + beta[0]
    for t in range(k):
        if t:
            prev = between[:, t - 1].gather(
                1, choice[:, t - 1, None, None].expand(-1, 1, c)).squeeze(1)
            step = (prev + unigram[:, t]) * inv + beta[t]
        # The exact conditional q(y_t | anchor, y_<t) of the lattice distribution.
        probs[:, t] = torch.softmax(step, dim=-1)
        if gumbel is None:
            choice[:, t] = torch.multinomial(probs[:, t], 1, generator=generator).squeeze(-1)
        else:
            choice[:, t] = (torch.log_softmax(step, dim=-1) + gumbel[:, t]).argmax(dim=-1)
    return choice, probs
