# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# (Triton kernels are written in its untyped DSL; the Python wrappers are typed.)
"""Grouped MXFP4 expert GEMMs: every routed expert of a MoE layer in one launch per
projection, for ``mxfp4-moe-triton``.

``kernelbay.layers.expert_blocks`` groups the routed slots (token t's k-th expert is slot
``t * K + k``) into blocks of ``BLOCK_M`` rows of one expert, on the device. A program of
``_grouped_kernel`` takes one block and one ``BLOCK_N`` tile of that expert's weight rows
(the stacked checkpoint bytes [E, N, K/2] read as halfwords, E8M0 bytes [E, N, K/32]),
decodes each K step in registers with the dense GEMM's decode (``triton_decode.decode_e2m1``,
exact bf16), multiplies the block's bf16 activation rows gathered by slot (row ``slot //
top_k`` of x for gate/up, row ``slot`` of h for down) with float32 accumulation, and stores
row ``slot`` of the output. The gate/up GEMM can take gate and up rows in one program and
store ``SiLU(gate) * up`` (``gated``), the down GEMM each row times its slot's routing
weight (``routing_weights``): the weight-only layer is then four launches on CUDA (routing,
two GEMMs, ``kernelbay.layers.slot_sum``'s float32 sum over each token's slots with its
rounding). Pad rows (slot ``num_slots``) are masked; blocks past the used ones (expert
``-1``) return at once, so the grid depends on the shapes alone and nothing is read on the
host: a decode step that runs these GEMMs can be captured in a CUDA graph.
Imported lazily by the MoE method (this module imports triton).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import triton
import triton.language as tl
from kernelbay import triton_pdl
from kernelbay.formats.bf16_triton import bf16_bits_rne
from kernelbay.formats.e2m1_words_triton import weight_dot
from kernelbay.triton_pdl import grid_release, grid_wait

from kernelbay_quant_mxfp4_rocm.triton_decode import decode_e2m1, decode_e2m1_fragment
from kernelbay_quant_mxfp4_rocm.triton_gemm import (
    FAST_SCALE_MAX_BYTE,
    _asm_target,
    layout_weight,
    prepare_weight,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from kernelbay.layers.expert_blocks import ExpertBlocks

__all__ = ["EXPERT_LAYOUTS", "GroupedConfig", "block_rows", "expert_layout", "grouped_mxfp4_gemm",
           "layout_experts", "prepare_experts"]


@dataclass(frozen=True)
class GroupedConfig:
    """Launch shape of one grouped GEMM: weight rows and K elements per program, warps,
    pipeline stages (rows per block come from the ``ExpertBlocks``). The default is the
    fastest of 13 shapes (or within 1% of it) for both projections from 1 to 256 tokens on an
    H100 with the gated, fragment-layout kernels
    (``bench/results/mxfp4-moe-sweep-h100.md``, ``bench/mxfp4/moe.py --configs``): fewer
    than 64 weight rows per program leave most of each wgmma idle (1.9-4.6x slower), and
    128-element K steps lose 1.2-1.7x."""

    block_n: int = 64
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 3

    @property
    def name(self) -> str:
        """Compact text, e.g. ``n64k128w4s3``."""
        return f"n{self.block_n}k{self.block_k}w{self.num_warps}s{self.num_stages}"

    @classmethod
    def parse(cls, text: str) -> GroupedConfig:
        """``"n64k128w4s3"`` -> ``GroupedConfig(64, 128, 4, 3)``."""
        found = re.fullmatch(r"n(\d+)k(\d+)w(\d+)s(\d+)", text)
        if not found:
            raise ValueError(f"grouped config {text!r}; expected n<block_n>k<block_k>w<warps>"
                             "s<stages>, e.g. n64k128w4s3")
        config = cls(*(int(v) for v in found.groups()))
        config.check(repr(text))
        return config

    def check(self, what: str) -> None:
        """``ValueError`` naming ``what`` unless the tile sizes and warps are powers of two
        (block_n >= 16, the MMA's least; block_k >= 32, one MX block) and stages >= 1."""
        for name, value, low in (("block_n", self.block_n, 16), ("block_k", self.block_k, 32),
                                 ("warps", self.num_warps, 1)):
            if value < low or value & (value - 1):
                raise ValueError(f"grouped config {what}: {name}={value}; valid: a power of "
                                 f"two >= {low}")
        if self.num_stages < 1:
            raise ValueError(f"grouped config {what}: stages={self.num_stages}; valid: >= 1")


#: The most blocks one launch takes: the grid's second dimension (CUDA's limit).
MAX_GRID_Y = 65535
#: Small tiles under the interpreter, which runs every lane of a tile on the CPU.
INTERPRETER_CONFIG = GroupedConfig(16, 64, 1, 1)


#: Stacked expert weight layouts: the checkpoint's packed bytes uint8 [E, N, K/2] and the
#: core's fragment-order words int32 [E, N, K/32, 4] (``kernelbay.formats.repack_e2m1_words``,
#: per expert row, as the dense GEMM's ``fragment`` path reads them).
EXPERT_LAYOUTS = ("checkpoint", "fragment")


def expert_layout(weight: torch.Tensor) -> str:
    """Which of ``EXPERT_LAYOUTS`` a stacked expert weight is in (``ValueError`` naming both
    when neither)."""
    import torch

    if weight.dtype == torch.uint8 and weight.dim() == 3:
        return "checkpoint"
    if weight.dtype == torch.int32 and weight.dim() == 4 and weight.shape[-1] == 4:
        return "fragment"
    raise ValueError(f"grouped_mxfp4_gemm: weight must be packed E2M1 uint8 [E, N, K/2] or "
                     f"fragment-order words int32 [E, N, K/32, 4], got {weight.dtype} "
                     f"{tuple(weight.shape)}")


def _per_row(convert: Callable[[torch.Tensor], torch.Tensor],
             weight: torch.Tensor) -> torch.Tensor:
    """``convert`` (a dense weight's layout change, row by row) applied to the stacked
    checkpoint bytes uint8 [E, N, K/2] as one [E * N, K/2] weight, restacked per expert."""
    experts, rows, half_k = weight.shape
    out = convert(weight.reshape(experts * rows, half_k))
    return out.view(experts, rows, *out.shape[1:])


def layout_experts(weight: torch.Tensor, layout: str) -> torch.Tensor:
    """The stacked checkpoint bytes uint8 [E, N, K/2] in ``layout`` (``EXPERT_LAYOUTS``)."""
    if layout not in EXPERT_LAYOUTS:
        raise ValueError(f"grouped_mxfp4_gemm: expert layout {layout!r}; valid: "
                         f"{EXPERT_LAYOUTS}")
    return _per_row(lambda w: layout_weight(w, layout), weight)


def prepare_experts(weight: torch.Tensor) -> torch.Tensor:
    """The stacked experts in the layout the dense GEMM's ``prepare_weight`` chooses on this
    machine: fragment-order words where the PTX decode runs (the decoded tile the register
    operand of a transposed product), the checkpoint bytes elsewhere."""
    return _per_row(prepare_weight, weight)


def block_rows(num_slots: int, num_experts: int) -> int:
    """Rows per block of ``expert_blocks``: 16 while experts average at most 16 routed slots
    (decode: a block is one expert's few tokens, the smallest MMA tile), then 32 and 64
    (prefill: each weight tile is read once per block, so fewer blocks read it less)."""
    mean = num_slots / max(min(num_experts, num_slots), 1)
    return 16 if mean <= 16 else 32 if mean <= 32 else 64


@triton.jit
def _weight_tile(w_rows, s_rows, x_tile, acc, k0, n_ok, K, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, ASM: tl.constexpr,
                 FAST: tl.constexpr, FRAGMENT: tl.constexpr, INTERPRET: tl.constexpr):
    """``acc + x_tile @ W[rows, k0:k0 + BLOCK_K]^T``, the weight tile decoded in registers;
    ``FRAGMENT``: the weight is fragment-order words and ``acc`` the transposed product
    ([BLOCK_N, rows]: the decoded tile is the dot's register operand)."""
    # codes per word: int16 halfwords hold four, fragment-order int32 words eight
    CODES: tl.constexpr = 8 if FRAGMENT else 4
    KW: tl.constexpr = BLOCK_K // CODES
    kw = k0 // CODES + tl.arange(0, KW)
    ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    if EVEN_K:
        w_ok = n_ok[:, None]
        s_ok = n_ok[:, None]
    else:
        w_ok = n_ok[:, None] & (kw[None, :] < K // CODES)
        s_ok = n_ok[:, None] & (ks[None, :] < K // 32)
    words = tl.load(w_rows + kw[None, :], mask=w_ok, other=0)
    sb = tl.load(s_rows + ks[None, :], mask=s_ok, other=0)
    if FRAGMENT:
        w = decode_e2m1_fragment(words, sb.to(tl.int32), BLOCK_N, KW, ASM, FAST)
    else:
        w = decode_e2m1(words, sb.to(tl.int32), BLOCK_N, KW, ASM, FAST)
    return weight_dot(x_tile, w, acc, FRAGMENT, INTERPRET)


@triton.jit
def _grouped_kernel(x_ptr, slot_ptr, expert_ptr, w_ptr, s_ptr, rw_ptr, out_ptr, N, K,
                    num_slots, stride_xm, stride_we, stride_wn, stride_se, stride_sn,
                    stride_om, ROW_DIV: tl.constexpr, GATED: tl.constexpr,
                    WEIGHTED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, ASM: tl.constexpr,
                    FAST: tl.constexpr, FRAGMENT: tl.constexpr, INTERPRET: tl.constexpr,
                    OUT_BF16_BITS: tl.constexpr, PDL: tl.constexpr = False):
    # x_ptr: bf16 activation rows, gathered at slot // ROW_DIV; slot_ptr / expert_ptr: the
    # ExpertBlocks tensors; w_ptr: int16 halfwords [E, N (GATED: 2N), K/4] (FRAGMENT: the
    # fragment-order int32 words [E, N, K/8], accumulated transposed); s_ptr: E8M0
    # bytes alike; rw_ptr (WEIGHTED): float32 routing weights [num_slots]; out_ptr:
    # [num_slots, N], row slot. GATED: rows n and N + n of the expert's weight are gate and
    # up, and the tile stored is SiLU(gate) * up (float32, then the store's rounding).
    # PDL (kernelbay.triton_pdl): wait for the kernel before (the routing, the gate/up GEMM)
    # before the first load; let the next launch start once the K loop is done
    if PDL:
        grid_wait()
    pid_n = tl.program_id(0)
    pid_b = tl.program_id(1)
    expert = tl.load(expert_ptr + pid_b)
    if expert >= 0:
        slots = tl.load(slot_ptr + pid_b * BLOCK_M + tl.arange(0, BLOCK_M))
        m_ok = slots < num_slots
        rows = tl.where(m_ok, slots // ROW_DIV, 0).to(tl.int64)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        rn64 = rn.to(tl.int64)
        e = expert.to(tl.int64)
        w_rows = w_ptr + e * stride_we + rn64[:, None] * stride_wn
        s_rows = s_ptr + e * stride_se + rn64[:, None] * stride_sn
        x_rows = x_ptr + rows[:, None] * stride_xm
        rk = tl.arange(0, BLOCK_K)
        if FRAGMENT:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if GATED:
            up = tl.zeros_like(acc)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            x_ok = m_ok[:, None] if EVEN_K else m_ok[:, None] & (kk[None, :] < K)
            xa = tl.load(x_rows + kk[None, :], mask=x_ok, other=0.0).to(tl.bfloat16)
            acc = _weight_tile(w_rows, s_rows, xa, acc, k0, n_ok, K, BLOCK_N, BLOCK_K, EVEN_K,
                               ASM, FAST, FRAGMENT, INTERPRET)
            if GATED:
                up = _weight_tile(w_rows + N * stride_wn, s_rows + N * stride_sn, xa, up, k0,
                                  n_ok, K, BLOCK_N, BLOCK_K, EVEN_K, ASM, FAST, FRAGMENT,
                                  INTERPRET)
        if PDL:
            grid_release()
        if GATED:  # SiLU(gate) * up in float32, as the fused SwiGLU kernels compute it
            acc = acc / (1.0 + tl.exp(-acc)) * up
        if FRAGMENT:
            acc = tl.trans(acc)
        if WEIGHTED:
            acc = acc * tl.load(rw_ptr + slots, mask=m_ok, other=0.0)[:, None]
        o_ptr = out_ptr + slots.to(tl.int64)[:, None] * stride_om + rn64[None, :]
        if OUT_BF16_BITS:  # noqa: SIM108 (a constexpr branch, not a runtime select)
            out = bf16_bits_rne(acc)
        else:
            out = acc.to(out_ptr.dtype.element_ty)
        tl.store(o_ptr, out, mask=m_ok[:, None] & n_ok[None, :])


def grouped_mxfp4_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       blocks: ExpertBlocks, *, gather: bool, out_dtype: torch.dtype,
                       gated: bool = False, routing_weights: torch.Tensor | None = None,
                       scale_max: int | None = None,
                       config: GroupedConfig | None = None) -> torch.Tensor:
    """Row ``s`` of the result is ``x[s // top_k if gather else s] @ dequantize_mx(weight[e],
    weight_scale[e], "e2m1")^T`` for slot s's expert e, [num_slots, N] in ``out_dtype``.

    ``x`` bf16 [rows, K]; ``weight`` the experts' packed E2M1 uint8 [E, N, K/2] (checkpoint
    layout) or its fragment-order words int32 [E, N, K/32, 4] (``prepare_experts``),
    ``weight_scale`` their E8M0 bytes uint8 [E, N, K/32]; ``blocks`` from
    ``expert_blocks(topk_ids, E, block_rows(...))``. ``gated``: the weight's rows are gate
    then up ([E, 2I, K/2]) and the result [num_slots, I] is ``SiLU(gate) * up``, computed in
    float32 before the store. ``routing_weights`` [T, top_k]: each row times its slot's
    weight (float32) before the store. ``scale_max``: the largest scale byte (at most 128
    selects the single-multiply decode, as in ``mxfp4_gemm``). Expert ids outside [0, E) are
    not checked here (that would read them on the host): the torch routing of
    ``expert_blocks`` fails on them, its Triton program leaves their slots out of every block,
    and their rows of the result are then undefined."""
    import torch

    fragment = expert_layout(weight) == "fragment"
    experts, rows_w = weight.shape[0], weight.shape[1]
    k = weight.shape[2] * (32 if fragment else 2)
    if k % 32 or tuple(weight_scale.shape) != (experts, rows_w, k // 32) \
            or weight_scale.dtype != torch.uint8:
        raise ValueError(f"grouped_mxfp4_gemm: weight_scale must be uint8 [{experts}, {rows_w}, "
                         f"{k // 32}] and K={k} a multiple of 32, got {weight_scale.dtype} "
                         f"{tuple(weight_scale.shape)}")
    if gated and rows_w % 2:
        raise ValueError(f"grouped_mxfp4_gemm: gated weight rows must be gate then up (an even "
                         f"count), got {rows_w}")
    n = rows_w // 2 if gated else rows_w
    rows = blocks.num_slots // max(blocks.top_k, 1) if gather else blocks.num_slots
    if x.dtype != torch.bfloat16 or tuple(x.shape) != (rows, k):
        raise ValueError(f"grouped_mxfp4_gemm: x must be bfloat16 [{rows}, {k}], got {x.dtype} "
                         f"{tuple(x.shape)}")
    if routing_weights is not None and routing_weights.numel() != blocks.num_slots:
        raise ValueError(f"grouped_mxfp4_gemm: routing_weights must hold one weight per slot "
                         f"({blocks.num_slots}), got shape {tuple(routing_weights.shape)}")
    out = torch.empty(blocks.num_slots, n, dtype=out_dtype, device=x.device)
    if blocks.num_slots == 0 or n == 0:
        return out
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    cfg = config or (INTERPRETER_CONFIG if interpret else GroupedConfig())
    cfg.check(f"{cfg.name} of grouped_mxfp4_gemm")
    if blocks.max_blocks > MAX_GRID_Y:
        raise ValueError(f"grouped_mxfp4_gemm: {blocks.max_blocks} blocks of {blocks.block_m} "
                         f"rows exceed the launch grid's {MAX_GRID_Y} (split the tokens)")
    x = x if x.stride(-1) == 1 else x.contiguous()
    # int16 halfwords [E, N, K/4] or the fragment-order int32 words as [E, N, K/8]
    words = (weight.contiguous().view(experts, rows_w, k // 8) if fragment
             else weight.contiguous().view(torch.int16))
    scales = weight_scale.contiguous()
    weights = (out if routing_weights is None  # unread without WEIGHTED
               else routing_weights.reshape(-1).to(torch.float32).contiguous())
    out_bits = interpret and out_dtype == torch.bfloat16
    grid = (triton.cdiv(n, cfg.block_n), blocks.max_blocks)
    pdl = triton_pdl.enabled(x.device)
    with triton_pdl.dependent(x.device, pdl):
        _grouped_kernel[grid](
            x, blocks.slots, blocks.experts, words, scales, weights,
            out.view(torch.int16) if out_bits else out, n, k, blocks.num_slots,
            x.stride(0), words.stride(0), words.stride(1), scales.stride(0), scales.stride(1),
            out.stride(0), ROW_DIV=blocks.top_k if gather else 1, GATED=gated,
            WEIGHTED=routing_weights is not None, BLOCK_M=blocks.block_m,
            BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=k % cfg.block_k == 0,
            ASM=not interpret and _asm_target(),
            FAST=scale_max is not None and scale_max <= FAST_SCALE_MAX_BYTE, FRAGMENT=fragment,
            INTERPRET=interpret, OUT_BF16_BITS=out_bits, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, PDL=pdl)
    return out
