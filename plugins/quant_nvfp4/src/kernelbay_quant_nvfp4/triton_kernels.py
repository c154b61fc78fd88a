# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# (Triton kernels are written in its untyped DSL; the Python wrappers are typed.)
"""Shared Triton pieces of ``nvfp4-triton``: the standalone dequantizer (the
dequantize-then-cuBLAS path at large M), the split-K reduction, the plain-Triton E2M1 and
E4M3 decodes, and the interpreter switch. The fused kernels are in ``triton_halfword``.

Weight layout (as loaded, nothing repacked): ``packed`` uint8 [N, K/2] (element 2i in the low
nibble, 2i+1 in the high one), ``scales`` float8_e4m3fn [N, K/16] (passed as a uint8 view),
``global_scale`` fp32 [].

Decoding one E2M1 code ``c`` (sign bit 3, magnitude index ``c & 7``) costs a few integer
ops: the fp16 bit pattern ``(c & 8) << 12 | (c & 7) << 9`` is exactly ``value * 2^-14`` for
all eight magnitudes (index 1 lands on the fp16 subnormal 2^-15 = 0.5 * 2^-14). An E4M3
scale byte ``b`` is decoded the same way: ``(b & 0x80) << 8 | (b & 0x7F) << 7`` is the fp16
pattern of ``S * 2^-8`` for normals and subnormals alike (integer decoding keeps compute
capability 8.0, which has no fp8 conversions, on the same path). The dequantizer folds the
powers of two into the per-block factor ``S * global * 2^22``, so its product equals the
reference's ``e2m1_value * (float(scale) * global)`` up to the order of exact power-of-two
factors: the dequantized weight is the reference's bit for bit before its cast to the
activation dtype.

Split-K (decode batches): the fused kernels write fp32 partials [split, M, N];
``splitk_reduce`` adds them in split order (deterministic), adds the bias and casts. The
stream-K build of the CUDA wgmma GEMM writes one partial per (CTA, row-tile segment);
``stream_fixup`` adds each row tile's segments in CTA order (= K order), the same way.

Interpreter: whether ``triton.jit`` builds an interpreted function is decided when the
decorator runs (``TRITON_INTERPRET``), so callers get the kernels through ``kernels()``, which
re-imports this module when the setting changed since it was imported; tests set the
variable in a fixture and get CPU-interpretable kernels without affecting anything else.
Modules whose kernels call the ``@triton.jit`` helpers here call ``kernels()`` before
re-importing themselves, so they import the helpers of the current mode.
This module imports triton: only the Triton linear methods import it, when they are built.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from kernelbay import triton_pdl
from kernelbay.triton_pdl import grid_release, grid_wait

__all__ = ["Nvfp4Kernels", "dequantize_nvfp4_triton", "e2m1_2m14", "e4m3_2m8", "interpreting",
           "kernels", "ptx_decodes", "scale_bits", "split_plan", "store_tile", "sum_partials",
           "sum_stream_segments"]


@dataclass(frozen=True)
class Nvfp4Kernels:
    """The jitted kernels of one mode (compiled or interpreted)."""

    reduce: Any
    dequant: Any
    stream_fixup: Any


@triton.jit
def e4m3_2m8(s_bits):
    """E4M3 bytes (uint8) -> fp32 ``S * 2^-8``, exact (from its fp16 bit pattern)."""
    b = s_bits.to(tl.int16)
    bits = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def e2m1_2m14(codes):
    """E2M1 codes (integers in 0..15) -> fp32 ``value * 2^-14``, exact."""
    c = codes.to(tl.int16)
    bits = ((c & 8) << 12) | ((c & 7) << 9)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def store_tile(acc, out_ptr, b_ptr, rm, rn, m_ok, n_ok, stride_om, split_offset,
               HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr):
    """Epilogue of a fused kernel: the fp32 tile ``acc`` [rows ``rm``, columns ``rn``] to
    ``out_ptr`` (row stride ``stride_om``): with ``PARTIAL`` as fp32 at ``split_offset`` (the
    split's partial), else plus the bias (``HAS_BIAS``) in the output dtype."""
    o_mask = m_ok[:, None] & n_ok[None, :]
    o_ptrs = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    if PARTIAL:
        tl.store(o_ptrs + split_offset, acc, mask=o_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def splitk_reduce(part_ptr, b_ptr, out_ptr, MN, N, SPLIT_K,
                  HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # the partials are the kernel before's output; the next launch may start now
        grid_wait()
        grid_release()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(part_ptr + s * MN + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def stream_fixup(part_ptr, b_ptr, out_ptr, M, N, C, U, P, SEGS,
                 HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
                 PDL: tl.constexpr = False):
    if PDL:  # as splitk_reduce
        grid_wait()
        grid_release()
    # Row tile r of ROWS rows, tokens [BLOCK_M * pid(1), ...): the CTAs q whose unit ranges
    # [q U // P, (q + 1) U // P) meet the tile's units [r C, r C + C), in order; the tile is
    # segment r - (first unit of q) // C of CTA q.
    r = tl.program_id(0)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.arange(0, ROWS)
    rn = r * ROWS + rows
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    q0 = ((r * C + 1) * P - 1) // U
    q1 = ((r * C + C) * P - 1) // U
    acc = tl.zeros((BLOCK_M, ROWS), dtype=tl.float32)
    for q in range(q0, q1 + 1):
        seg = r - (q * U // P) // C
        base = (q * SEGS + seg).to(tl.int64) * M * ROWS
        acc += tl.load(part_ptr + base + rm.to(tl.int64)[:, None] * ROWS + rows[None, :],
                       mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def nvfp4_dequant(w_ptr, s_ptr, g_ptr, out_ptr, N, K,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    HALF: tl.constexpr = BLOCK_K // 2
    GROUPS: tl.constexpr = BLOCK_K // 16
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    kh = tl.program_id(1) * HALF + tl.arange(0, HALF)
    kg = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    n_ok = offs_n < N
    h_ok = kh < K // 2
    w = tl.load(w_ptr + offs_n[:, None] * (K // 2) + kh[None, :],
                mask=n_ok[:, None] & h_ok[None, :], other=0)
    s = tl.load(s_ptr + offs_n[:, None] * (K // 16) + kg[None, :],
                mask=n_ok[:, None] & (kg < K // 16)[None, :], other=0)
    blk = e4m3_2m8(s) * (tl.load(g_ptr).to(tl.float32) * 4194304.0)  # global * 2^14 * 2^8
    # One factor per 8 packed bytes (16 elements): broadcast along K.
    blk = tl.reshape(tl.broadcast_to(blk[:, :, None], (BLOCK_N, GROUPS, 8)),
                     (BLOCK_N, HALF))
    lo = (e2m1_2m14(w & 15) * blk).to(out_ptr.dtype.element_ty)
    hi = (e2m1_2m14(w >> 4) * blk).to(out_ptr.dtype.element_ty)
    # Interleave: element 2i is the low nibble of byte i.
    out = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K))
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + offs_n[:, None] * K + offs_k[None, :], out,
             mask=n_ok[:, None] & (offs_k < K)[None, :])


def interpreting() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for Triton's interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


#: The mode the decorators above ran in.
_BUILT_INTERPRETED = interpreting()


def kernels() -> Nvfp4Kernels:
    """The kernels for the current ``TRITON_INTERPRET`` setting: when it differs from the one
    this module was imported under, the module is re-executed so the decorators run again."""
    if interpreting() != _BUILT_INTERPRETED:
        importlib.reload(triton_pdl)  # the jitted helpers this module imports, in the new mode
        module = importlib.reload(sys.modules[__name__])
        return module.kernels()  # type: ignore[no-any-return]
    return Nvfp4Kernels(splitk_reduce, nvfp4_dequant, stream_fixup)


def ptx_decodes(x: torch.Tensor) -> bool:
    """Whether kernels on ``x``'s device take the PTX decode (``ASM``): a CUDA build of torch
    running compiled kernels on a CUDA tensor (not ROCm, not the interpreter)."""
    return x.is_cuda and not interpreting() and torch.version.hip is None


def scale_bits(scales: torch.Tensor) -> torch.Tensor:
    """E4M3 block scales as the uint8 bytes the kernels decode (see the module doc)."""
    return scales.view(torch.uint8) if scales.dtype == torch.float8_e4m3fn else scales


def split_plan(k_tiles: int, split_k: int) -> tuple[int, int]:
    """``(splits, K tiles per split)`` for ``split_k`` asked over ``k_tiles`` tiles: at most
    one split per tile and no empty splits."""
    split_k = max(1, min(split_k, k_tiles))
    per_split = -(-k_tiles // split_k)
    return -(-k_tiles // per_split), per_split


def sum_partials(part: torch.Tensor, bias: torch.Tensor | None,
                 out: torch.Tensor, *, pdl: bool = False) -> torch.Tensor:
    """``out [M, N] = sum of part [split, M, N] in split order (+ bias)``, cast to out's
    dtype, by ``splitk_reduce`` (``pdl``: built to wait and release, ``kernelbay.triton_pdl``;
    launched plainly after its GEMM, so the next GEMM may depend on it programmatically)."""
    split_k, m, n = part.shape
    block = 1024
    with triton_pdl.dependent(part.device, pdl, depend=False):
        kernels().reduce[(-(-(m * n) // block),)](part, bias if bias is not None else out,
                                                  out, m * n, n, SPLIT_K=split_k,
                                                  HAS_BIAS=bias is not None, BLOCK=block,
                                                  PDL=pdl)
    return out


def sum_stream_segments(part: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                        chunks: int, *, pdl: bool = False) -> torch.Tensor:
    """``out [M, N]`` from the stream-K partials ``part [P, segments, M, rows]`` of row tiles
    of ``rows`` rows and ``chunks`` K chunks each (``cuda_wgmma.stream_plan``): each tile's
    segments added in CTA order (+ bias), cast to out's dtype, by ``stream_fixup`` (``pdl``:
    as ``sum_partials``)."""
    ctas, segments, m, rows = part.shape
    n = out.shape[1]
    if out.stride(1) != 1 or out.stride(0) != n:
        raise ValueError(f"nvfp4 stream-K sum: needs a contiguous [M, N] output, got strides "
                         f"{tuple(out.stride())}")
    row_tiles = -(-n // rows)
    block_m = 16
    with triton_pdl.dependent(part.device, pdl, depend=False):
        kernels().stream_fixup[(row_tiles, -(-m // block_m))](
            part, bias if bias is not None else out, out, m, n, chunks, row_tiles * chunks,
            ctas, segments, HAS_BIAS=bias is not None, ROWS=rows, BLOCK_M=block_m, PDL=pdl)
    return out


def dequantize_nvfp4_triton(packed: torch.Tensor, scales: torch.Tensor,
                            global_scale: torch.Tensor, dtype: torch.dtype,
                            out: torch.Tensor | None = None, *, block_n: int = 32,
                            block_k: int = 256) -> torch.Tensor:
    """The dense [N, K] weight in ``dtype`` (into ``out`` when given, e.g. a reused
    temporary): the reference's float32 values cast to ``dtype``, bit for bit."""
    n, k = packed.shape[0], 2 * packed.shape[1]
    scales = scale_bits(scales)
    if out is None:
        out = torch.empty(n, k, dtype=dtype, device=packed.device)
    grid = (-(-n // block_n), -(-k // block_k))
    kernels().dequant[grid](packed, scales, global_scale, out, n, k,
                            BLOCK_N=block_n, BLOCK_K=block_k)
    return out
