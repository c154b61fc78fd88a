"""Top-k over a vocabulary-parallel LM head without gathering the vocabulary.

With the vocabulary split across tensor-parallel ranks, each rank finds its own top-k logits
and only the (value, global id) pairs travel: 2k numbers per row and rank, so the traffic is
O(batch * 2k * tp_size) instead of O(batch * vocab). The merge orders by value, then by lower
global id, exactly as ``topk_lower_id`` does on the whole vocabulary, so the drafter's
candidate lattice (``CandidateSelector.candidates``) is the same at every tensor-parallel size.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernelbay_spec_dflash2.modules import topk_lower_id

__all__ = ["merge_topk", "vocab_parallel_topk"]


def merge_topk(values: torch.Tensor, ids: torch.Tensor, k: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` best of candidate pairs ``values``/``ids`` [B, n]: larger value first, equal
    values by lower id."""
    by_id = ids.argsort(dim=-1, stable=True)
    values, ids = values.gather(-1, by_id), ids.gather(-1, by_id)
    by_value = values.argsort(dim=-1, descending=True, stable=True)[..., :k]
    return values.gather(-1, by_value), ids.gather(-1, by_value)


def vocab_parallel_topk(local: torch.Tensor, k: int, vocab_start: int, vocab_size: int,
                        all_gather: Callable[[torch.Tensor], torch.Tensor]
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Global top-``k`` (values [B, k] float32, ids [B, k] int64) of logits split by vocabulary.

    ``local`` [B, V_local] is this rank's shard, covering global ids ``vocab_start ..
    vocab_start + V_local - 1`` (ids from ``vocab_size`` on are padding and never chosen);
    ``all_gather`` concatenates a [B, n] tensor of every rank along the last dim, in rank
    order (``Collective.all_gather``). Each rank sends its k best as one float64 [B, 2k]
    tensor (values and ids are exact in float64).
    """
    if local.dim() != 2:
        raise ValueError(f"vocab_parallel_topk: expected local logits [B, V_local], got "
                         f"{tuple(local.shape)}")
    if not 1 <= k <= vocab_size:
        raise ValueError(f"vocab_parallel_topk: k must be in [1, vocab_size={vocab_size}], "
                         f"got {k}")
    rows, width = local.shape
    ids = vocab_start + torch.arange(width, device=local.device)
    values = local.float().masked_fill(ids[None, :] >= vocab_size, float("-inf"))
    if width < k:  # a narrow shard: pad with losers (-inf, ids past the vocabulary)
        pad = k - width
        values = torch.cat([values, values.new_full((rows, pad), float("-inf"))], dim=-1)
        ids = torch.cat([ids, vocab_size + torch.arange(pad, device=local.device)])
    best, where = topk_lower_id(values, k)
    pairs = torch.cat([best.double(), ids[where].double()], dim=-1)     # [B, 2k]
    gathered = all_gather(pairs).view(rows, -1, 2 * k)                  # [B, tp, 2k]
    merged_values, merged_ids = merge_topk(gathered[..., :k].flatten(1),
                                           gathered[..., k:].flatten(1), k)
    return merged_values.float(), merged_ids.long()
