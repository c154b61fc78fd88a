"""Routing grouped by expert for grouped-GEMM MoE kernels, made on the device.

A grouped MoE kernel runs one program per (block of routed rows, output tile): every row of a
block is routed to the same expert, so the program reads one expert's weight tile and
applies it to up to ``block_m`` rows. ``expert_blocks`` builds that grouping from the router's
``topk_ids`` [T, K] with tensor operations only: no value is read on the host, so a decode
step that uses it can be captured in a CUDA graph, and the grid size depends on the shapes
alone.

Rows are *slots*: slot ``s = t * K + k`` is token t's k-th routed expert, so a kernel reads
the token's activations at row ``s // K`` and its routing weight at ``topk_weights.flatten()
[s]``. Each expert's slots are in ascending order (so in token order) and padded to whole
blocks with ``num_slots`` (= T * K), which a kernel masks. The number of blocks used is not
known on the host; the grid covers the most there can be (``max_blocks``: the slots' whole
blocks plus one partial block per routed expert, at most ``min(E, T * K)`` of them), and the
blocks past the used ones have expert ``-1``: their programs return at once.

Two implementations with the same result: tensor operations (any device), and Triton programs
for CUDA routings (``kernel="auto"`` picks them there): up to ``SMALL_SLOTS`` slots one
program over one tile of slots (1.7-5.0 us on an H100 for 8-64 slots), above it three
launches of one program per chunk of slots (per-chunk expert counts, one program turning them
into each chunk's offsets, a scatter; ``expert_blocks_triton``: 11.7-30.1 us for 128-8192
slots). The torch version is about fifteen small kernels (52-131 us for 8-8192 slots), which
inside a captured step cost more than the programs
(``bench/results/moe-routing-multi-h100.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["KERNELS", "ExpertBlocks", "expert_blocks", "max_blocks"]


@dataclass(frozen=True)
class ExpertBlocks:
    """Routed slots grouped into blocks of ``block_m`` rows of one expert each.

    ``slots`` int32 [max_blocks * block_m]: the slot (``t * top_k + k``) of each block row,
    ``num_slots`` for padding; ``experts`` int32 [max_blocks]: each block's expert, ``-1`` for
    unused blocks (always after the used ones)."""

    slots: torch.Tensor
    experts: torch.Tensor
    block_m: int
    num_slots: int
    top_k: int

    @property
    def max_blocks(self) -> int:
        """The grid's block dimension (used and unused blocks)."""
        return int(self.experts.shape[0])


def max_blocks(num_slots: int, num_experts: int, block_m: int) -> int:
    """The most blocks ``num_slots`` routed slots can need over ``num_experts`` experts: an
    expert with c slots takes ``ceil(c / block_m) <= floor(c / block_m) + 1`` blocks, the
    floors add up to at most ``floor(num_slots / block_m)``, and at most
    ``min(num_experts, num_slots)`` experts are routed."""
    return num_slots // block_m + min(num_experts, num_slots)


KERNELS = ("auto", "torch", "triton")


def expert_blocks(topk_ids: torch.Tensor, num_experts: int, block_m: int, *,
                  kernel: str = "auto") -> ExpertBlocks:
    """The blocks of ``topk_ids`` [T, K] (expert ids in ``[0, num_experts)``, each token's
    distinct or not) for kernels with ``block_m``-row blocks. ``kernel``: one of ``KERNELS``
    (``"auto"``: the Triton programs for CUDA routings, else tensor operations).
    ``ValueError`` on a bad shape, ``block_m`` or ``kernel``. Ids outside the range are not
    checked (that would read them on the host): the tensor operations fail on them (an index
    error, on CUDA a device-side assert), the Triton program leaves their slots out of every
    block."""
    import torch

    if kernel not in KERNELS:
        raise ValueError(f"expert_blocks: kernel={kernel!r}; valid: {KERNELS}")
    if topk_ids.dim() != 2:
        raise ValueError(f"expert_blocks: topk_ids must be [tokens, top_k], got shape "
                         f"{tuple(topk_ids.shape)}")
    if block_m < 1 or num_experts < 1:
        raise ValueError(f"expert_blocks: block_m={block_m} and num_experts={num_experts} "
                         "must both be >= 1")
    device = topk_ids.device
    n = topk_ids.numel()
    blocks = max_blocks(n, num_experts, block_m)
    if kernel == "triton" or (kernel == "auto" and _triton_takes(topk_ids)):
        from kernelbay.layers.expert_blocks_triton import fill_expert_blocks

        slots = torch.empty(blocks * block_m, dtype=torch.int32, device=device)
        experts = torch.empty(blocks, dtype=torch.int32, device=device)
        fill_expert_blocks(topk_ids, num_experts, block_m, slots, experts)
        return ExpertBlocks(slots, experts, block_m, n, int(topk_ids.shape[1]))
    flat = topk_ids.reshape(-1).long()
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    per_expert = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(per_expert, 0)
    first_slot = torch.cumsum(counts, 0) - counts
    # A stable sort keeps each expert's slots in token order.
    order = torch.sort(flat, stable=True).indices
    ranked = flat[order]
    rank = torch.arange(n, device=device) - first_slot[ranked]
    position = (block_end - per_expert)[ranked] * block_m + rank
    slots = torch.full((blocks * block_m,), n, dtype=torch.int32, device=device)
    slots.scatter_(0, position, order.to(torch.int32))
    experts = torch.searchsorted(block_end, torch.arange(blocks, device=device), right=True)
    experts = torch.where(experts < num_experts, experts, -1).to(torch.int32)
    return ExpertBlocks(slots, experts, block_m, n, int(topk_ids.shape[1]))


def _triton_takes(topk_ids: torch.Tensor) -> bool:
    """Whether ``kernel="auto"`` runs the Triton programs: CUDA ids, at least one slot,
    Triton installed."""
    if not topk_ids.is_cuda or topk_ids.numel() == 0:
        return False
    import importlib.util

    return importlib.util.find_spec("triton") is not None
