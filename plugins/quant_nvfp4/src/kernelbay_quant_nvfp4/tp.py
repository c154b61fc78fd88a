"""Tensor-parallel sharding of block scales.

Block scales shard with the weight rows (column parallel) or columns (row parallel) they
cover. One scale covers ``block`` weight elements along the split dimension: 1 along N for
NVFP4 and MX (one scale row per weight row), 16 along K for NVFP4, 128 along N or K for FP8
per-block. When every rank's share of the weight is a whole number of blocks, rank ``r``
takes scale blocks ``[r * shard / block, (r + 1) * shard / block)``.

When a rank's share is smaller than one scale block (a small per-rank output such as a
linear-attention gate projection under TP 8 with 128-row FP8 blocks), splitting the scales
would hand some ranks no scale at all, or a scale cut in two. Those scales are REPLICATED:
every rank holds all of them and indexes them by its weight's global offset. The same holds
when a share is larger than a block but does not end on a block boundary. This module is
torch-free at import (tensors are only sliced).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["ScaleSharding", "block_scale_sharding", "shard_block_scales"]

ScaleSharding = Literal["split", "replicate"]


def _check(size: int, tp_size: int, block: int, tp_rank: int | None = None) -> None:
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    if tp_rank is not None and not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must be in [0, {tp_size - 1}], got {tp_rank}")
    if block < 1:
        raise ValueError(f"block must be >= 1 weight element, got {block}")
    if size < 1 or size % tp_size:
        raise ValueError(f"the weight dimension of {size} elements is not divisible by "
                         f"tensor-parallel size {tp_size}")


def block_scale_sharding(size: int, tp_size: int, block: int) -> ScaleSharding:
    """``"split"`` when each rank's share of ``size`` weight elements is a whole number of
    ``block``-element scale blocks, else ``"replicate"``."""
    _check(size, tp_size, block)
    shard = size // tp_size
    return "split" if shard % block == 0 else "replicate"


def shard_block_scales(scales: Tensor, dim: int, tp_rank: int, tp_size: int, block: int,
                       *, size: int | None = None) -> Tensor:
    """Rank ``tp_rank``'s part of block ``scales`` split along ``dim``.

    ``block`` is how many weight elements one scale covers along ``dim``; ``size`` is the
    weight's full length along ``dim`` (default ``scales.shape[dim] * block``). Returns a
    slice (a view) when the scales split, and the whole tensor when a rank's share is
    smaller than one block or not aligned to blocks (``block_scale_sharding``).
    """
    if not -scales.dim() <= dim < scales.dim():
        raise ValueError(f"dim {dim} is out of range for scales of shape {tuple(scales.shape)}")
    dim %= scales.dim()
    blocks = scales.shape[dim]
    size = blocks * block if size is None else size
    _check(size, tp_size, block, tp_rank)
    if blocks != -(-size // block):
        raise ValueError(f"scales have {blocks} blocks along dim {dim}, but {size} weight "
                         f"elements in blocks of {block} need {-(-size // block)}")
    if block_scale_sharding(size, tp_size, block) == "replicate":
        return scales
    per_rank = size // tp_size // block
    return scales.narrow(dim, tp_rank * per_rank, per_rank)
