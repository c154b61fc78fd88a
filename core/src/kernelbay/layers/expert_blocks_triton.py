# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# (Triton kernels are written in its untyped DSL; the Python wrapper is typed.)
"""``expert_blocks`` in Triton programs, with the tensor operations' result bit for bit.

The torch version is about fifteen small kernels (a stable sort among them); inside a
captured step each still costs a few microseconds, 52-131 us in all on an H100 for 8-8192
slots (``bench/results/moe-routing-multi-h100.md``). Every slot keeps its place as the stable
sort leaves it: in its expert's blocks at ``rank``, the number of earlier slots routed to the
same expert, so each expert's slots stay in slot order.

Up to ``SMALL_SLOTS`` slots (decode batches) one program over one tile of slots
(``expert_blocks_small_kernel``): each slot's rank and its expert's count by comparing every
slot with every slot, the blocks before its expert by adding the block counts of the experts
with smaller ids (each counted at its first slot), each block's owner by which expert's block
range holds it.

Any number of slots: the multi-program routing (``program="multi"``), three launches, each
slot's work done by the program of its chunk of slots (``multi_chunk``):

* ``chunk_counts_kernel``: each chunk's count per expert (a [chunks, experts] table), and a
  share of ``slots`` set to the padding value;
* ``chunk_bases_kernel`` (one program): each expert's blocks from its total, and the table
  turned in place into each (chunk, expert)'s first row: the expert's first block times
  ``block_m`` plus its slots in earlier chunks; each block's expert (how many experts' blocks
  end at or before it, ``-1`` past the last);
* ``chunk_scatter_kernel``: each slot written at its chunk's base for its expert plus its rank
  among the chunk's earlier slots of that expert, so the pairwise comparison stays within a
  chunk.

It replaced a single program that did the same over every slot (its rank quadratic in all
the slots, so bounded to 256 of them): 16.5 and 33.5 us at 128 and 256 slots against 11.7
and 14.6 (``bench/results/moe-routing-multi-h100.md``). This module imports triton:
``expert_blocks`` imports it only for CUDA tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import triton
import triton.language as tl

from kernelbay import triton_pdl
from kernelbay.triton_pdl import grid_release, grid_wait

if TYPE_CHECKING:
    import torch

__all__ = ["MULTI_CHUNKS", "MULTI_CHUNK_SIZES", "PROGRAMS", "SMALL_SLOTS", "chunk_bases_kernel",
           "chunk_counts_kernel", "chunk_scatter_kernel", "expert_blocks_small_kernel",
           "fill_expert_blocks", "multi_chunk"]

#: The most slots the one-tile program takes (``program="auto"`` runs it up to here). On an
#: H100 (``bench/results/moe-routing-multi-h100.md``, 8 warps) it made 8 / 32 / 64 slots in
#: 1.7 / 2.0 / 5.0 us against 8.8 / 7.9 / 9.5 for the multi-program routing; at 128 slots its
#: slot-by-slot tiles took 33-75 us (``moe-routing-h100.md``), and at 256 its compile had not
#: finished after 100 s.
SMALL_SLOTS = 64
#: ``program`` choices of ``fill_expert_blocks``.
PROGRAMS = ("auto", "multi", "small")
#: Most programs per launch the multi-program routing's default chunk aims for: its one-program
#: offsets step walks the [chunks, experts] table serially.
MULTI_CHUNKS = 64
#: The slots per program the multi-program routing takes (its scatter compares a chunk's slots
#: pairwise, its counts compare them with every expert: larger tiles compile for minutes).
MULTI_CHUNK_SIZES = (16, 32, 64, 128, 256)
_CHUNK = 64


@triton.jit
def _ids(ids_ptr, offsets, num_slots, num_experts):
    """The expert ids at ``offsets`` as int32, -1 past the slots and for ids outside
    ``[0, num_experts)`` (so such slots join no block: no write can leave the buffers)."""
    ok = offsets < num_slots
    raw = tl.load(ids_ptr + offsets, mask=ok, other=0)
    # range-checked in the ids' own dtype, narrowed only once known to fit
    good = ok & (raw >= 0) & (raw < num_experts)
    return tl.where(good, raw.to(tl.int32), -1)


@triton.jit
def _wait_then_release(PDL: tl.constexpr):
    """With ``PDL`` (``kernelbay.triton_pdl``): wait for the kernel before (its writes
    visible) before touching memory, then let the next launch start its programs, which only
    wait too: the three launches of the multi-program routing follow each other."""
    if PDL:
        grid_wait()
        grid_release()


@triton.jit
def _pad_rows(slots_ptr, start, stop, num_slots, CHUNK: tl.constexpr):
    """Block rows ``[start, stop)`` set to the padding value ``num_slots``, ``CHUNK`` per store
    (the slots are written over it afterwards)."""
    for p in range(start, stop, CHUNK):
        lanes = p + tl.arange(0, CHUNK)
        tl.store(slots_ptr + lanes, tl.zeros((CHUNK,), dtype=tl.int32) + num_slots,
                 mask=lanes < stop)


@triton.jit
def chunk_counts_kernel(ids_ptr, counts_ptr, slots_ptr, num_slots, num_experts, size, pad,
                        EXPERTS: tl.constexpr, CHUNK: tl.constexpr, PAD: tl.constexpr,
                        PDL: tl.constexpr = False):
    """Program p: how many of slots ``[p * CHUNK, (p + 1) * CHUNK)`` route to each expert
    (``counts`` row p), and block rows ``[p * pad, (p + 1) * pad)`` set to the padding value
    (the scatter, a later launch, writes the slots over it)."""
    _wait_then_release(PDL)
    p = tl.program_id(0)
    ids = _ids(ids_ptr, p * CHUNK + tl.arange(0, CHUNK), num_slots, num_experts)
    e_idx = tl.arange(0, EXPERTS)
    counts = tl.sum((ids[:, None] == e_idx[None, :]).to(tl.int32), axis=0)
    tl.store(counts_ptr + p * EXPERTS + e_idx, counts)
    _pad_rows(slots_ptr, p * pad, tl.minimum((p + 1) * pad, size), num_slots, PAD)


@triton.jit
def chunk_bases_kernel(counts_ptr, experts_ptr, chunks, num_experts, blocks,
                       BLOCK_M: tl.constexpr, EXPERTS: tl.constexpr, ROWS: tl.constexpr,
                       LANES: tl.constexpr, PDL: tl.constexpr = False):
    """One program: each expert's blocks from its total count, then ``counts`` turned in place
    into each (chunk, expert)'s first block row, ``expert's first block * BLOCK_M`` plus the
    expert's slots in earlier chunks; and each block's expert, ``-1`` past the used ones."""
    _wait_then_release(PDL)
    e_idx = tl.arange(0, EXPERTS)
    total = tl.zeros((EXPERTS,), dtype=tl.int32)
    for r in range(0, chunks, ROWS):
        rows = r + tl.arange(0, ROWS)
        at = counts_ptr + rows[:, None] * EXPERTS + e_idx[None, :]
        total += tl.sum(tl.load(at, mask=rows[:, None] < chunks, other=0), axis=0)
    per_expert = (total + BLOCK_M - 1) // BLOCK_M
    block_end = tl.cumsum(per_expert, 0)
    carry = (block_end - per_expert) * BLOCK_M
    for r in range(0, chunks, ROWS):
        rows = r + tl.arange(0, ROWS)
        at = counts_ptr + rows[:, None] * EXPERTS + e_idx[None, :]
        counts = tl.load(at, mask=rows[:, None] < chunks, other=0)
        before = tl.cumsum(counts, 0) - counts  # this tile's earlier chunks
        tl.store(at, carry[None, :] + before, mask=rows[:, None] < chunks)
        carry += tl.sum(counts, axis=0)
    # Lanes past num_experts count no slots, so their ends equal the last expert's: they add
    # to a block's count only past the used blocks, whose count is already >= num_experts.
    for b in range(0, blocks, LANES):
        block = b + tl.arange(0, LANES)
        owner = tl.sum((block_end[None, :] <= block[:, None]).to(tl.int32), axis=1)
        owner = tl.where(owner < num_experts, owner, -1)
        tl.store(experts_ptr + block, owner, mask=block < blocks)


@triton.jit
def chunk_scatter_kernel(ids_ptr, bases_ptr, slots_ptr, num_slots, num_experts,
                         EXPERTS: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr = False):
    """Program p: each of its chunk's slots written at its (chunk, expert) base plus its rank
    among the chunk's earlier slots of the same expert."""
    _wait_then_release(PDL)
    p = tl.program_id(0)
    lanes = tl.arange(0, CHUNK)
    ids = _ids(ids_ptr, p * CHUNK + lanes, num_slots, num_experts)
    valid = ids >= 0
    same = (ids[:, None] == ids[None, :]) & (lanes[None, :] < lanes[:, None])
    rank = tl.sum(same.to(tl.int32), axis=1)
    base = tl.load(bases_ptr + p * EXPERTS + ids, mask=valid, other=0)
    tl.store(slots_ptr + base + rank, p * CHUNK + lanes, mask=valid)


@triton.jit
def expert_blocks_small_kernel(ids_ptr, slots_ptr, experts_ptr, num_slots, num_experts, blocks,
                               BLOCK_M: tl.constexpr, SLOTS: tl.constexpr,
                               BLOCKS: tl.constexpr, CHUNK: tl.constexpr,
                               PDL: tl.constexpr = False):
    """The blocks from one tile of slots (one program): ``SLOTS`` and
    ``BLOCKS`` powers of two at least ``num_slots`` and ``blocks`` (``fill_expert_blocks``
    chooses them; smaller ones would drop slots)."""
    _wait_then_release(PDL)
    mine = tl.arange(0, SLOTS)
    ids = _ids(ids_ptr, mine, num_slots, num_experts)
    valid = ids >= 0
    same = (ids[:, None] == ids[None, :]) & valid[:, None]  # [slot, other slot]
    rank = tl.sum((same & (mine[None, :] < mine[:, None])).to(tl.int32), axis=1)
    count = tl.sum(same.to(tl.int32), axis=1)
    per_expert = (count + BLOCK_M - 1) // BLOCK_M
    # each routed expert counted once, at its first slot
    first = valid & (rank == 0)
    earlier = first[None, :] & (ids[None, :] < ids[:, None])
    block_start = tl.sum(tl.where(earlier, per_expert[None, :], 0), axis=1)
    _pad_rows(slots_ptr, 0, blocks * BLOCK_M, num_slots, CHUNK)
    tl.debug_barrier()  # the padding is written before any slot lands on it
    tl.store(slots_ptr + block_start * BLOCK_M + rank, mine, mask=valid)
    block = tl.arange(0, BLOCKS)
    holds = first[None, :] & (block_start[None, :] <= block[:, None]) \
        & (block[:, None] < (block_start + per_expert)[None, :])
    owner = tl.sum(tl.where(holds, ids[None, :], 0), axis=1)
    owner = tl.where(tl.sum(holds.to(tl.int32), axis=1) > 0, owner, -1)
    tl.store(experts_ptr + block, owner, mask=block < blocks)


def multi_chunk(num_slots: int) -> int:
    """The multi-program routing's default slots per program: 64, or the least power of two
    that keeps the chunks at most ``MULTI_CHUNKS``, at most 256 (the largest of
    ``MULTI_CHUNK_SIZES``: a cap, not a measured best; past 8192 slots no size was timed). On
    an H100 (256 experts, top-8,
    ``bench/results/moe-routing-multi-h100.md``) 64-slot chunks were the fastest from 128 to
    2048 slots (11.7-17.4 us against 12.3-17.5 for 128) and 128-slot ones at 8192 slots
    (30.1 us against 33.9)."""
    return min(MULTI_CHUNK_SIZES[-1],
               max(64, int(triton.next_power_of_2(triton.cdiv(num_slots, MULTI_CHUNKS)))))


def fill_expert_blocks(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                       slots: torch.Tensor, experts: torch.Tensor, *, program: str = "auto",
                       num_warps: int | None = None, chunk: int | None = None) -> None:
    """Write the blocks of ``topk_ids`` into ``slots`` and ``experts`` (int32, sized by
    ``expert_blocks.max_blocks``). Ids outside ``[0, num_experts)`` put their slot in no
    block. ``program``: one of ``PROGRAMS`` (``"auto"``: the one-tile program up to
    ``SMALL_SLOTS`` slots, else the multi-program one); ``num_warps``: each program's warps
    (default 8 for the one-tile program, 4 for the others, the fastest measured); ``chunk``:
    the slots per program of the multi-program routing (one of ``MULTI_CHUNK_SIZES``; default
    ``multi_chunk``). All three are tuning knobs with the same result. ``ValueError`` past
    ``SMALL_SLOTS`` slots for the one-tile program, on an unknown program, a chunk outside
    ``MULTI_CHUNK_SIZES``, indices past int32 or buffers of another size or dtype."""
    import torch

    from kernelbay.layers.expert_blocks import max_blocks

    flat = topk_ids.reshape(-1)  # any integer dtype: the kernel widens each id to int32
    n = flat.numel()
    if program not in PROGRAMS:
        raise ValueError(f"fill_expert_blocks: program={program!r}; valid: {PROGRAMS}")
    if program == "auto":
        program = "small" if n <= SMALL_SLOTS else "multi"
    if program == "small" and n > SMALL_SLOTS:
        raise ValueError(f"fill_expert_blocks: {n} routed slots, the one-tile program takes at "
                         f"most SMALL_SLOTS={SMALL_SLOTS}")
    chunk = multi_chunk(n) if chunk is None else chunk
    if chunk not in MULTI_CHUNK_SIZES:
        raise ValueError(f"fill_expert_blocks: chunk={chunk}; valid: {MULTI_CHUNK_SIZES}")
    blocks = max_blocks(n, num_experts, block_m)
    chunks = max(1, triton.cdiv(n, chunk))
    size = blocks * block_m
    width = max(16, triton.next_power_of_2(num_experts))
    # the programs index slots, block rows (padded to whole shares) and the [chunks, experts]
    # table in int32
    if max(chunks * triton.cdiv(size, chunks), chunks * width) >= 2**31:
        raise ValueError(f"fill_expert_blocks: {n} routed slots in {blocks} blocks of "
                         f"{block_m} rows over {num_experts} experts; the programs index fewer "
                         "than 2**31 block rows and chunk counts")
    for name, t, want in (("slots", slots, size), ("experts", experts, blocks)):
        if t.dtype != torch.int32 or t.numel() != want or not t.is_contiguous():
            raise ValueError(f"fill_expert_blocks: {name} must be a contiguous int32 tensor of "
                             f"{want} elements for {n} slots, {num_experts} experts "
                             f"and block_m={block_m}; got {t.dtype} {tuple(t.shape)}")
    pdl = triton_pdl.enabled(flat.device)

    def opts(default: int) -> dict[str, Any]:
        return {"num_warps": num_warps or default, "PDL": pdl} if topk_ids.is_cuda else {}

    if program == "small":
        with triton_pdl.dependent(flat.device, pdl):
            expert_blocks_small_kernel[(1,)](
                flat, slots, experts, n, num_experts, blocks, BLOCK_M=block_m,
                SLOTS=max(16, triton.next_power_of_2(n)),
                BLOCKS=max(16, triton.next_power_of_2(blocks)), CHUNK=256, **opts(8))
        return
    bases = torch.empty(chunks * width, dtype=torch.int32, device=flat.device)
    with triton_pdl.dependent(flat.device, pdl):
        chunk_counts_kernel[(chunks,)](flat, bases, slots, n, num_experts, size,
                                       triton.cdiv(size, chunks), EXPERTS=width, CHUNK=chunk,
                                       PAD=256, **opts(4))
    with triton_pdl.dependent(flat.device, pdl):
        chunk_bases_kernel[(1,)](bases, experts, chunks, num_experts, blocks, BLOCK_M=block_m,
                                 EXPERTS=width, ROWS=max(1, 4096 // width), LANES=_CHUNK,
                                 **opts(4))
    with triton_pdl.dependent(flat.device, pdl):
        chunk_scatter_kernel[(chunks,)](flat, bases, slots, n, num_experts, EXPERTS=width,
                                        CHUNK=chunk, **opts(4))
