"""Speculative decoding: a proposer drafts up to k tokens, one target forward verifies them.

Each step, for every running sequence: the proposer drafts ``d <= k`` tokens; the target runs
once over the uncached tokens plus the drafts, which gives logits for the ``d + 1`` positions
that follow the committed text; at each of them the target picks its token exactly as plain
decoding would (``sample_tokens``: greedy, or Gumbel-max with noise keyed by seed, position
and token id). Drafts are accepted while they equal the target's own pick; the first
mismatch is replaced by the target's token, and when all ``d`` match the target's next token
is a bonus. The output is therefore identical to plain decoding with the same seed, whatever
the proposer drafts. The KV cache keeps the entries of accepted tokens; rejected drafts'
entries lie beyond ``num_cached`` and are overwritten by the next step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import final

import torch

from kernelbay.engine.runner import ModelRunner, Sequence
from kernelbay.engine.sampling import sample_tokens
from kernelbay.layers import DraftBuffers, Proposer

__all__ = ["SpeculativeConfig", "speculative_step"]


@final
@dataclass(frozen=True)
class SpeculativeConfig:
    """Which proposer drafts (``method``, e.g. ``"ngram"`` or ``"dflash2"``), how many tokens
    per step (``num_speculative_tokens``), and the drafter weights where the method needs them."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    drafter: str | None = None

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got "
                             f"{self.num_speculative_tokens}")


def speculative_step(runner: ModelRunner, proposer: Proposer, buffers: DraftBuffers,
                     running: list[Sequence]) -> list[list[int]]:
    """One draft-and-verify step for ``running``; returns each sequence's new tokens (at
    least one each) and leaves ``tokens``/``num_cached`` consistent with them."""
    k = buffers.tokens.shape[1]
    proposer.propose([torch.tensor(s.tokens) for s in running], buffers)
    committed = [len(s.tokens) for s in running]
    drafts: list[list[int]] = []
    for row, seq in enumerate(running):
        room = seq.params.max_tokens - len(seq.generated) - 1
        count = max(0, min(int(buffers.num_drafted[row]), k, room))
        drafts.append([int(t) for t in buffers.tokens[row, :count].tolist()])
        seq.tokens.extend(drafts[-1])
    batch = [(s, len(s.tokens) - s.num_cached) for s in running]
    logits = runner.forward(batch, all_logits=True)
    # The last d + 1 rows of each sequence predict the positions after the committed text.
    rows: list[int] = []
    params = []
    positions: list[int] = []
    start = 0
    for (seq, num_new), base, draft in zip(batch, committed, drafts, strict=True):
        first = start + num_new - len(draft) - 1
        rows.extend(range(first, start + num_new))
        params.extend([seq.params] * (len(draft) + 1))
        positions.extend(range(base, base + len(draft) + 1))
        start += num_new
    picks = sample_tokens(logits[torch.tensor(rows, device=logits.device)], params,
                          positions).tolist()
    out: list[list[int]] = []
    offset = 0
    for seq, base, draft in zip(running, committed, drafts, strict=True):
        target = [int(t) for t in picks[offset:offset + len(draft) + 1]]
        offset += len(draft) + 1
        accepted = 0
        while accepted < len(draft) and draft[accepted] == target[accepted]:
            accepted += 1
        new = [*draft[:accepted], target[accepted]]
        del seq.tokens[base:]
        seq.tokens.extend(new)
        seq.num_cached = base + accepted
        out.append(new)
    return out
