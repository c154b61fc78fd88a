# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# (Triton kernels are written in its untyped DSL; the Python wrappers are typed.)
"""Grouped NVFP4 expert GEMMs: every routed expert of a MoE layer in two kernel launches
(three when the gate/up GEMM splits K).

``kernelbay.layers.expert_blocks`` groups the routed slots (token t's k-th expert is slot
``t * K + k``) into blocks of ``BLOCK_M`` rows of one expert, on the device. Each program of
``nvfp4_grouped_gemm`` takes one block and one ``BLOCK_N`` tile of weight rows, reads that
expert's tile in the layer's stored layout (``grouped_weights``) and decodes it in registers
with the K loop of ``nvfp4-triton``'s fused kernel (``triton_halfword.weight_k_loop``),
gathering its activation rows by slot:

* gate/up (``GATED``): rows ``slot // K`` of x against the paired gate/up weight (a turn of
  ``BLOCK_N / 2`` gate rows, then the same up rows), one K loop; the tile is split into its
  gate and up halves, each times its own ``weight_scale_2``, and ``SiLU(gate) * up`` (float32)
  is stored in x's dtype at row ``slot`` of ``h`` [T * K, I];
* down: rows ``slot`` of ``h``, times the down ``weight_scale_2`` and the slot's routing
  weight, stored in float32 at row ``slot`` of ``y`` [T * K, H].

``nvfp4_grouped_experts`` then adds ``y`` over each token's K slots in slot order (float32,
deterministic) and rounds once (``kernelbay.layers.slot_sum``, one launch on CUDA). Blocks
past the used ones (expert -1) do nothing, so the grid depends on the shapes alone and nothing
is read on the host: the experts run inside a captured CUDA graph exactly as eagerly. This
module imports triton: the MoE method imports it when it runs.
"""

from __future__ import annotations

import importlib
import re
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import triton
import triton.language as tl
from kernelbay import triton_pdl
from kernelbay.formats import e2m1_words_triton
from kernelbay.layers.slot_sum import sum_slots
from kernelbay.triton_pdl import grid_release, grid_wait

from kernelbay_quant_nvfp4 import triton_halfword
from kernelbay_quant_nvfp4.cuda_gemv import device_index, sm_count
from kernelbay_quant_nvfp4.grouped_weights import ExpertWeight
from kernelbay_quant_nvfp4.triton_halfword import stored_weight_rows, weight_k_loop
from kernelbay_quant_nvfp4.triton_kernels import interpreting, kernels, ptx_decodes, split_plan

if TYPE_CHECKING:
    import torch
    from kernelbay.layers.expert_blocks import ExpertBlocks

__all__ = ["GroupedConfig", "block_m_for", "gate_up_splits", "grouped_kernel",
           "nvfp4_grouped_experts"]

#: K elements per tile of the fragment-order layouts (the ``pt``/``pf`` M <= 16 kernels'
#: tile); the checkpoint and repacked layouts take 64-element K tiles, the most those
#: kernels take for ragged K.
BLOCK_K_FRAGMENT = 256
BLOCK_K_OTHER = 64


@dataclass(frozen=True)
class GroupedConfig:
    """Launch shape of the grouped GEMMs: weight rows per program of the down GEMM (the
    gate/up GEMM takes two turns of its paired weight), warps, pipeline stages. The default
    was the fastest or within 2% of it from 1 to 1024 tokens on the H200
    (``bench/results/nvfp4-moe-h200.md``)."""

    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 3
    #: The gate/up GEMM splits K (``gate_up_splits``) while its programs number fewer than
    #: this many per SM; 0 never splits.
    split_per_sm: int = 2

    @property
    def name(self) -> str:
        return f"n{self.block_n}w{self.num_warps}s{self.num_stages}p{self.split_per_sm}"

    @classmethod
    def parse(cls, text: str) -> GroupedConfig:
        """``"n128w4s3p2"`` -> ``GroupedConfig(128, 4, 3, 2)`` (``p`` optional)."""
        found = re.fullmatch(r"n(\d+)w(\d+)s(\d+)(?:p(\d+))?", text)
        if not found:
            raise ValueError(f"grouped config {text!r}; expected n<block_n>w<warps>s<stages>"
                             "[p<split_per_sm>], e.g. n128w4s3p2")
        config = cls(*(int(v) for v in found.groups() if v is not None))
        for what, value in (("block_n", config.block_n), ("warps", config.num_warps)):
            if value < (16 if what == "block_n" else 1) or value & (value - 1):
                raise ValueError(f"grouped config {text!r}: {what}={value}; valid: a power of "
                                 f"two >= {16 if what == 'block_n' else 1}")
        if config.num_stages < 1:
            raise ValueError(f"grouped config {text!r}: stages={config.num_stages}; valid: >= 1")
        return config


@triton.jit
def nvfp4_grouped_gemm(x_ptr, slot_ptr, expert_ptr, w_ptr, s_ptr, g_ptr, ug_ptr, rw_ptr, out_ptr,
                       part_ptr, N, ROWS, K, num_slots, tiles_per_split, part_stride, stride_xm,
                       stride_we, stride_se, stride_wn, stride_sn, stride_om, TOP_K: tl.constexpr,
                       GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, ASM: tl.constexpr,
                       INTERPRET: tl.constexpr, REPACKED: tl.constexpr, SWAP: tl.constexpr,
                       TILED: tl.constexpr, SPLIT: tl.constexpr = 1,
                       FINISH: tl.constexpr = False, PDL: tl.constexpr = False):
    # x_ptr: activation rows, gathered at slot // TOP_K; slot_ptr / expert_ptr: the
    # ExpertBlocks tensors; w_ptr / s_ptr: the stacked stored weight (ROWS rows per expert,
    # stride_we / stride_se elements apart); g_ptr fp32 [E] weight_scale_2 (ug_ptr: the up
    # projection's, GATED); rw_ptr: the routing weights [T * TOP_K] (down); out_ptr: [T *
    # TOP_K, N] at row slot (N = I for GATED). Split K (GATED only): with SPLIT > 1 and not
    # FINISH, program_id(2) multiplies K tiles [pid * tiles_per_split, ...) and stores its raw
    # tile, float32, in part_ptr [SPLIT, T * TOP_K, ROWS] (part_stride = T * TOP_K * ROWS
    # apart: from the host, as num_slots may be 1 and then a compile-time constant); FINISH
    # adds the SPLIT parts in order instead of reading the weight, then finishes as unsplit.
    # PDL (kernelbay.triton_pdl): wait for the kernel before (the routing, the other GEMM, the
    # split parts) before the first load; let the next launch start once the tile is made.
    if PDL:
        grid_wait()
    pid_n = tl.program_id(0)
    pid_b = tl.program_id(1)
    expert = tl.load(expert_ptr + pid_b)
    if expert >= 0:
        slots = tl.load(slot_ptr + pid_b * BLOCK_M + tl.arange(0, BLOCK_M))
        m_ok = slots < num_slots
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < ROWS
        e = expert.to(tl.int64)
        x_rows = x_ptr + (slots // TOP_K).to(tl.int64)[:, None] * stride_xm
        part_rows = part_ptr + slots.to(tl.int64)[:, None] * ROWS + rn[None, :]
        part_ok = m_ok[:, None] & n_ok[None, :]
        if FINISH:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(SPLIT):
                acc += tl.load(part_rows + s * part_stride, mask=part_ok, other=0.0)
        else:
            if SWAP:
                acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            else:
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            w_rows, s_rows = stored_weight_rows(w_ptr + e * stride_we, s_ptr + e * stride_se,
                                                rn, K, stride_wn, stride_sn, TILED)
            first = 0
            last = tl.cdiv(K, BLOCK_K)
            if SPLIT > 1:
                first = tl.program_id(2) * tiles_per_split
                last = tl.minimum(first + tiles_per_split, last)
            acc = weight_k_loop(acc, x_rows, w_rows, s_rows, m_ok, n_ok, K, first, last,
                                BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, ASM, INTERPRET, False,
                                REPACKED, SWAP, TILED)
            if SWAP:
                acc = tl.trans(acc)
        if PDL:
            grid_release()
        # The decoded weight is e2m1 * S * 2^-8: weight_scale_2 * 2^8 finishes it (after the
        # splits are added, for a split GEMM).
        if SPLIT > 1 and not FINISH:
            tl.store(part_rows + tl.program_id(2) * part_stride, acc, mask=part_ok)
        elif GATED:
            TURN: tl.constexpr = BLOCK_N // 2
            gate, up = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, TURN)), (0, 2, 1)))
            gate = gate * (tl.load(g_ptr + e) * 256.0)
            up = up * (tl.load(ug_ptr + e) * 256.0)
            out = gate / (1.0 + tl.exp(-gate)) * up
            cn = pid_n * TURN + tl.arange(0, TURN)
        else:
            route = tl.load(rw_ptr + slots, mask=m_ok, other=0.0).to(tl.float32)
            out = acc * (tl.load(g_ptr + e) * 256.0) * route[:, None]
            cn = rn
        if SPLIT == 1 or FINISH:
            o_ptrs = out_ptr + slots.to(tl.int64)[:, None] * stride_om + cn[None, :]
            tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty),
                     mask=m_ok[:, None] & (cn < N)[None, :])


#: The mode the decorator above ran in.
_BUILT_INTERPRETED = interpreting()


def grouped_kernel() -> Any:
    """The jitted ``nvfp4_grouped_gemm`` for the current ``TRITON_INTERPRET`` setting (re-executes
    the modules whose helpers it calls when the setting changed, as ``hw_kernel`` does)."""
    if interpreting() != _BUILT_INTERPRETED:
        kernels()
        importlib.reload(e2m1_words_triton)
        importlib.reload(triton_halfword)
        return importlib.reload(sys.modules[__name__]).grouped_kernel()
    return nvfp4_grouped_gemm


def block_m_for(num_slots: int, num_experts: int) -> int:
    """Rows per block: 16 while experts average at most 16 routed rows (decode: a block is
    mostly one expert's few tokens), then 32 and 64 (prefill: fewer weight re-reads)."""
    mean = num_slots / max(num_experts, 1)
    return 16 if mean <= 16 else 32 if mean <= 32 else 64


def _launch(x: torch.Tensor, blocks: ExpertBlocks, weight: ExpertWeight,
            route: torch.Tensor | None, out: torch.Tensor, top_k: int,
            config: GroupedConfig) -> None:
    """One grouped GEMM into ``out`` (rows by slot): gate/up with SiLU for a paired weight,
    else the down projection times the routing weights ``route``."""
    import torch

    swap = weight.layout in ("fragment", "tiles")
    block_k = BLOCK_K_FRAGMENT if swap else BLOCK_K_OTHER
    block_n = 2 * weight.turn if weight.turn else config.block_n
    stride_wn, stride_sn = weight.row_strides()
    interp = interpreting()
    opts: dict[str, Any] = ({"num_warps": config.num_warps, "num_stages": config.num_stages}
                            if x.is_cuda else {})
    grid = (-(-weight.rows // block_n), blocks.max_blocks)
    if grid[1] == 0:
        return
    k_tiles = -(-weight.k // block_k)
    splits, per_split = 1, k_tiles
    if weight.turn:
        sms = sm_count(device_index(x)) if x.is_cuda else 132
        splits, per_split = split_plan(k_tiles, gate_up_splits(
            grid[0] * min(blocks.num_slots, blocks.max_blocks), k_tiles, sms,
            config.split_per_sm))
    part = (torch.empty(splits, blocks.num_slots, weight.rows, dtype=torch.float32,
                        device=x.device) if splits > 1 else out)

    pdl = triton_pdl.enabled(x.device)

    def run(grid: tuple[int, ...], finish: bool) -> None:
        with triton_pdl.dependent(x.device, pdl):
            grouped_kernel()[grid](
                x, blocks.slots, blocks.experts, weight.words, weight.scales, weight.global_scale,
                weight.up_scale if weight.up_scale is not None else weight.global_scale,
                route if route is not None else out, out, part, weight.n, weight.rows, weight.k,
                blocks.num_slots, per_split, blocks.num_slots * weight.rows, x.stride(0),
                weight.words.stride(0), weight.scales.stride(0), stride_wn, stride_sn,
                out.stride(0), TOP_K=top_k,
                GATED=weight.turn > 0, BLOCK_M=blocks.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                EVEN_K=weight.k % block_k == 0,
                ASM=ptx_decodes(x), INTERPRET=interp,
                REPACKED=weight.layout in ("repacked", "fragment", "tiles"), SWAP=swap,
                TILED=weight.layout == "tiles", SPLIT=splits, FINISH=finish,
                PDL=pdl, **opts)

    if splits > 1:
        run((*grid, splits), False)
        run(grid, True)
    else:
        run(grid, False)


def gate_up_splits(programs: int, k_tiles: int, sms: int, per_sm: int) -> int:
    """K splits of the gate/up GEMM: doubled while ``programs`` (row tiles times the blocks
    there can be) times the splits stay within ``per_sm`` per SM and K has at least four
    tiles per split after the doubling (``per_sm`` 0: 1; ``split_plan`` then spreads the tiles,
    the last split possibly shorter). A split stores raw float32 tiles that a second launch
    adds in split order before SiLU (deterministic)."""
    splits = 1
    while per_sm and programs * splits * 2 <= per_sm * sms and k_tiles >= 4 * splits:
        splits *= 2
    return splits


def nvfp4_grouped_experts(x: torch.Tensor, blocks: ExpertBlocks, topk_weights: torch.Tensor,
                          gate_up: ExpertWeight, down: ExpertWeight,
                          config: GroupedConfig | None = None) -> torch.Tensor:
    """``sum_k topk_weights[t, k] * down_e(SiLU(gate_e(x_t)) * up_e(x_t))`` for
    ``e = topk_ids[t, k]`` (the routing ``blocks`` was made from), [T, H] in x's dtype.
    ``gate_up``: ``grouped_weights.paired_weight``; ``config``: ``GroupedConfig()`` unless
    given. Every routed id must lie in ``[0, E)``: a slot the routing leaves out (an id
    outside, which is not checked on the host) leaves its row of the result undefined."""
    import torch

    tokens, top_k = topk_weights.shape
    bm = blocks.block_m
    if (x.shape[0], blocks.num_slots, blocks.top_k) != (tokens, tokens * top_k, top_k) \
            or not gate_up.turn or bm < 16 or bm & (bm - 1):
        raise ValueError(f"nvfp4 grouped experts: x has {x.shape[0]} rows, topk_weights "
                         f"{tuple(topk_weights.shape)}, the blocks {blocks.num_slots} slots of "
                         f"top-{blocks.top_k} in {bm}-row blocks, gate_up turn {gate_up.turn}; "
                         "expected T rows, [T, K], T * K slots of top-K in blocks of a power "
                         "of two >= 16 rows, and a paired gate/up weight")
    if (x.shape[1], down.k) != (gate_up.k, gate_up.n):
        raise ValueError(f"nvfp4 grouped experts: x [{x.shape[0]}, {x.shape[1]}], gate/up "
                         f"{gate_up.n}x{gate_up.k}, down {down.n}x{down.k}; expected x's "
                         "width = gate/up's K and down's K = gate/up's N (the intermediate)")
    x = x.contiguous()
    config = config or GroupedConfig()
    h = torch.empty(blocks.num_slots, gate_up.n, dtype=x.dtype, device=x.device)
    _launch(x, blocks, gate_up, None, h, top_k, config)
    y = torch.empty(blocks.num_slots, down.n, dtype=torch.float32, device=x.device)
    route = topk_weights.reshape(-1).float().contiguous()
    _launch(h, blocks, down, route, y, 1, config)
    return sum_slots(y, top_k, x.dtype)  # slot order, float32, one rounding
