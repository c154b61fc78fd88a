# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# (Triton kernels are written in its untyped DSL; the Python wrappers are typed.)
"""Triton kernels for weight-only NVFP4: ``y = x @ dequant(W)^T`` with the weight decoded in
registers, and a standalone dequantizer (for the dequantize-then-cuBLAS path at large M).

Weight layout (as loaded, nothing repacked): ``packed`` uint8 [N, K/2] (element 2i in the low
nibble, 2i+1 in the high one), ``scales`` float8_e4m3fn [N, K/16], ``global_scale`` fp32 [].

Decoding one E2M1 code ``c`` (sign bit 3, magnitude index ``i = c & 7``) costs a few integer
ops: the fp16 bit pattern ``(c & 8) << 12 | (c & 7) << 9`` is exactly ``value * 2^-14`` for
all eight magnitudes (index 1 lands on the fp16 subnormal 2^-15 = 0.5 * 2^-14). The 2^14 is
folded into the per-block factor ``float(scale) * global * 2^14``, computed once per 16
elements (the E4M3 scale is decoded from its bits the same way, ``(b & 0x7F) << 7`` being
its fp16 pattern times 2^-8; the scales are passed as a uint8 view), so each element needs one int->fp16 bitcast, one widening and one fp32 multiply;
the product equals the reference's ``e2m1_value * (float(scale) * global)`` up to the order of
two exact power-of-two factors, so the dequantized weight is the reference's bit for bit
before its cast to the activation dtype.

The packed halves are never interleaved: ``x``'s tile is loaded contiguously and split in
registers into even columns (they multiply the low nibbles) and odd ones (the high nibbles),
two ``tl.dot`` per K tile accumulating in fp32.

``DOT16`` variant (fewer ALU operations per weight element, which bound the decode kernel
once the weight is 4 bits): the weight goes to fp16 without fp32: ``code16 * fp16(s * 2^7)``
equals ``e2m1 * s * 2^-7`` exactly (at most 6 significant bits, between 2^-17 and 21, all
fp16-representable), one packed fp16 multiply per two elements; ``weight_scale_2 * 2^7`` is
applied to the fp32 accumulator at the end. The activation tile is scaled per row by a power
of two that puts its largest magnitude in [2^14, 2^15) and converted to fp16, exact for bf16
and fp16 inputs (only entries below 2^-29 of the row's largest lose bits); the partial dot
is scaled back by the inverse power of two. So the products are those of the exact
dequantized weight (the bf16 path rounds each weight to bf16 first).

Prepared activations (``xprep``; ``x_prepare`` + ``nvfp4_matmul_xp``): the DOT16 scaling
of x done once per call and per row instead of per K tile in every CTA: each row times
the power of two that puts its largest magnitude in [2^14, 2^15), converted to fp16 (exact
for bf16 and fp16 entries down to 2^-29 of the row's largest, well below the output's
rounding), with each K tile's columns reordered to the decode order of the int32 words
(slice j of a tile holds columns 8i + j) and zero-padded to whole tiles. The K loop is then
word loads, the PTX decode, 8 fp16 slice loads of x and 8 dots; the per-row inverse power
of two and ``weight_scale_2 * 2^7`` multiply the accumulator once. The packed weight keeps
its checkpoint layout (no repacking; ``dequantized_weight`` reads it unchanged).
``nvfp4_matmul_xpt`` is the same with the operands swapped (``out^T = W x^T``): Hopper's
warpgroup MMA takes its first operand from registers, so the decoded weight goes straight
from the decode to the MMA, and the batch rows are the MMA's N dimension.

Small M (decode) is memory bound: split-K gives enough CTAs to fill the GPU (partial sums in
an fp32 workspace, reduced by a second small kernel that adds the bias and casts). Large M
uses the same kernel with larger tiles, or the dequantizer then ``F.linear`` (cuBLAS).

Interpreter: whether ``triton.jit`` builds an interpreted function is decided when the
decorator runs (``TRITON_INTERPRET``), so callers get the kernels through ``kernels()``, which
re-imports this module when the setting changed since it was imported; tests set the
variable in a fixture and get CPU-interpretable kernels without affecting anything else.
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

__all__ = ["Nvfp4Kernels", "dequantize_nvfp4_triton", "kernels", "nvfp4_linear_triton",
           "prepare_x"]

@dataclass(frozen=True)
class Nvfp4Kernels:
    """The jitted kernels of one mode (compiled or interpreted)."""

    matmul: Any
    reduce: Any
    dequant: Any
    matmul_w8: Any
    x_prepare: Any
    matmul_xp: Any
    matmul_xpt: Any


@triton.jit
def _scale_factor(s_bits, factor):
    # E4M3 bits (viewed as uint8) -> fp16 bits: (b & 0x7F) << 7 is the magnitude * 2^-8
    # for normals and subnormals alike; the 2^8 sits in ``factor``. Integer decoding
    # keeps compute capability 8.0 (no fp8 conversions there) on the same path.
    b = s_bits.to(tl.int16)
    bits = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return bits.to(tl.float16, bitcast=True).to(tl.float32) * factor

@triton.jit
def _decode(codes, block_factor):
    # codes: uint8 nibbles in 0..15 -> fp32 value * block factor (exact, see module doc).
    c = codes.to(tl.int16)
    bits = ((c & 8) << 12) | ((c & 7) << 9)
    return bits.to(tl.float16, bitcast=True).to(tl.float32) * block_factor

@triton.jit
def nvfp4_matmul(x_ptr, w_ptr, s_ptr, g_ptr, b_ptr, out_ptr,
                 M, N, K, stride_xm, stride_wn, stride_sn, stride_om, stride_os,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, TILES_PER_SPLIT, PARTIAL: tl.constexpr,
                 DOT_FP32: tl.constexpr, DOT16: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    HALF: tl.constexpr = BLOCK_K // 2
    GROUPS: tl.constexpr = BLOCK_K // 16
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, HALF)
    offs_kx = tl.arange(0, BLOCK_K)
    offs_g = tl.arange(0, GROUPS)
    m_ok = offs_m < M
    n_ok = offs_n < N
    kh_total = K // 2
    kg_total = K // 16
    factor = tl.load(g_ptr).to(tl.float32) * 4194304.0  # global * 2^14 * 2^8
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = pid_k * TILES_PER_SPLIT
    for t in range(first, first + TILES_PER_SPLIT):
        kh = t * HALF + offs_h  # packed column (pair of K columns)
        kg = t * GROUPS + offs_g  # block-scale column
        h_ok = kh < kh_total
        # Weight tile as [HALF, BLOCK_N] (K along rows) so tl.dot needs no transpose.
        w = tl.load(w_ptr + offs_n[None, :] * stride_wn + kh[:, None],
                    mask=h_ok[:, None] & n_ok[None, :], other=0)
        s = tl.load(s_ptr + offs_n[None, :] * stride_sn + kg[:, None],
                    mask=(kg < kg_total)[:, None] & n_ok[None, :], other=0)
        # x as one contiguous [BLOCK_M, BLOCK_K] tile (vector loads), split in registers into
        # the even columns (low nibbles) and odd ones (high nibbles).
        kx = t * BLOCK_K + offs_kx
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kx[None, :],
                    mask=m_ok[:, None] & (kx < K)[None, :], other=0.0)
        if DOT16:
            # fp16 dot, exact operands (module doc, "DOT16"): weights code16 * fp16(s * 2^7),
            # x scaled per row of the tile by a power of two into fp16's top octave.
            sb = s.to(tl.int16)
            s16 = (((sb & 0x80) << 8) | ((sb & 0x7F) << 7)).to(tl.float16, bitcast=True)
            s16 = s16 * 32768.0  # s * 2^-8 * 2^15 = s * 2^7 <= 57344, exact
            s16 = tl.reshape(tl.broadcast_to(s16[:, None, :], (GROUPS, 8, BLOCK_N)),
                             (HALF, BLOCK_N))
            lo = (w & 15).to(tl.int16)
            hi = (w >> 4).to(tl.int16)
            w_lo = (((lo & 8) << 12) | ((lo & 7) << 9)).to(tl.float16, bitcast=True) * s16
            w_hi = (((hi & 8) << 12) | ((hi & 7) << 9)).to(tl.float16, bitcast=True) * s16
            xf = x.to(tl.float32)
            rmax = tl.max(tl.abs(xf), axis=1)
            expo = (rmax.to(tl.int32, bitcast=True) >> 23) & 0xFF
            shift = tl.minimum(tl.maximum(141 - expo, -126), 126)  # rmax * 2^shift ~ 2^14
            up = ((shift + 127) << 23).to(tl.float32, bitcast=True)
            down = ((127 - shift) << 23).to(tl.float32, bitcast=True)
            xs = (xf * up[:, None]).to(tl.float16)
            xs_even, xs_odd = tl.split(tl.reshape(xs, (BLOCK_M, HALF, 2)))
            part = tl.dot(xs_even, w_lo)
            part = tl.dot(xs_odd, w_hi, part)
            acc += part * down[:, None]
        else:
            blk = _scale_factor(s, factor)  # [GROUPS, BLOCK_N]
            # One factor per 8 packed bytes (16 elements): broadcast along K.
            blk = tl.reshape(tl.broadcast_to(blk[:, None, :], (GROUPS, 8, BLOCK_N)),
                             (HALF, BLOCK_N))
            w_lo = _decode(w & 15, blk).to(x_ptr.dtype.element_ty)
            w_hi = _decode(w >> 4, blk).to(x_ptr.dtype.element_ty)
            x_even, x_odd = tl.split(tl.reshape(x, (BLOCK_M, HALF, 2)))
            if DOT_FP32:
                # Interpreter only: its tl.dot multiplies bfloat16 as raw uint16 bits, so the
                # (exactly representable) operands are widened; the products are the same.
                acc += tl.dot(x_even.to(tl.float32), w_lo.to(tl.float32))
                acc += tl.dot(x_odd.to(tl.float32), w_hi.to(tl.float32))
            else:
                acc += tl.dot(x_even, w_lo)
                acc += tl.dot(x_odd, w_hi)
    if DOT16:
        acc = acc * (tl.load(g_ptr).to(tl.float32) * 128.0)  # global * 2^7
    o_mask = m_ok[:, None] & n_ok[None, :]
    if not PARTIAL:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        tl.store(out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :],
                 acc, mask=o_mask)

# PTX for two packed-weight words (8 nibbles each, $8 and $9) and their block scales as fp16
# pairs ($10 = fp16(s * 2^7) of each word): outputs $0..$7 are nibble j of both words as
# fp16 pairs, already times the scale. prmt puts byte p of each word in the high byte of one
# 16-bit lane; the high nibble's sign/magnitude then sit at bits 15/12-14 and go to 15/9-11
# (>> 3), the low nibble's at 11/8-10 (<< 4, << 1): the fp16 pattern of value * 2^-14.
_DECODE8_PTX = tl.constexpr("""{
.reg .b32 q, t, u;
""" + "".join(f"""prmt.b32 q, $8, $9, {hex(((4 + p) << 12) | ((4 + p) << 8) | (p << 4) | p)};
shl.b32 t, q, 4;
and.b32 t, t, 0x80008000;
shl.b32 u, q, 1;
and.b32 u, u, 0x0E000E00;
or.b32 t, t, u;
mul.rn.f16x2 ${2 * p}, t, $10;
and.b32 t, q, 0x80008000;
shr.b32 u, q, 3;
and.b32 u, u, 0x0E000E00;
or.b32 t, t, u;
mul.rn.f16x2 ${2 * p + 1}, t, $10;
""" for p in range(4)) + "}")


@triton.jit
def _nibble16(words, j: tl.constexpr, s16):
    # Portable form of one output of _DECODE8_PTX: nibble j of each int32 word, as fp16
    # (value * 2^-14), times the fp16 scale.
    c = ((words >> (4 * j)) & 15).to(tl.int16)
    return (((c & 8) << 12) | ((c & 7) << 9)).to(tl.float16, bitcast=True) * s16


@triton.jit
def nvfp4_matmul_w8(x_ptr, w_ptr, s_ptr, g_ptr, b_ptr, out_ptr,
                    M, N, K, stride_xm, stride_wn, stride_sn, stride_om, stride_os,
                    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, TILES_PER_SPLIT, PARTIAL: tl.constexpr,
                    ASM: tl.constexpr):
    """The DOT16 kernel reading the packed weight as int32 words of 8 nibbles (``w_ptr``
    is the int32 view, ``stride_wn`` in words): 8 dots of BLOCK_K/8 per tile, element 8i+j
    of the tile in output j of word i. ``ASM`` decodes with ``_DECODE8_PTX`` (CUDA)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    W8: tl.constexpr = BLOCK_K // 8
    GROUPS: tl.constexpr = BLOCK_K // 16
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, W8)
    offs_kx = tl.arange(0, BLOCK_K)
    offs_g = tl.arange(0, GROUPS)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = pid_k * TILES_PER_SPLIT
    for t in range(first, first + TILES_PER_SPLIT):
        kw = t * W8 + offs_w
        kg = t * GROUPS + offs_g
        words = tl.load(w_ptr + offs_n[None, :] * stride_wn + kw[:, None],
                        mask=(kw < K // 8)[:, None] & n_ok[None, :], other=0)
        s = tl.load(s_ptr + offs_n[None, :] * stride_sn + kg[:, None],
                    mask=(kg < K // 16)[:, None] & n_ok[None, :], other=0)
        sb = s.to(tl.int16)
        s16 = (((sb & 0x80) << 8) | ((sb & 0x7F) << 7)).to(tl.float16, bitcast=True) * 32768.0
        s16 = tl.reshape(tl.broadcast_to(s16[:, None, :], (GROUPS, 2, BLOCK_N)), (W8, BLOCK_N))
        if ASM:
            w0, w1, w2, w3, w4, w5, w6, w7 = tl.inline_asm_elementwise(
                _DECODE8_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r", [words, s16],
                dtype=(tl.float16,) * 8, is_pure=True, pack=2)
        else:
            w0 = _nibble16(words, 0, s16)
            w1 = _nibble16(words, 1, s16)
            w2 = _nibble16(words, 2, s16)
            w3 = _nibble16(words, 3, s16)
            w4 = _nibble16(words, 4, s16)
            w5 = _nibble16(words, 5, s16)
            w6 = _nibble16(words, 6, s16)
            w7 = _nibble16(words, 7, s16)
        kx = t * BLOCK_K + offs_kx
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kx[None, :],
                    mask=m_ok[:, None] & (kx < K)[None, :], other=0.0)
        xf = x.to(tl.float32)
        rmax = tl.max(tl.abs(xf), axis=1)
        expo = (rmax.to(tl.int32, bitcast=True) >> 23) & 0xFF
        shift = tl.minimum(tl.maximum(141 - expo, -126), 126)
        up = ((shift + 127) << 23).to(tl.float32, bitcast=True)
        down = ((127 - shift) << 23).to(tl.float32, bitcast=True)
        xs = (xf * up[:, None]).to(tl.float16)
        # Column 8i + j of the tile is element (i, j = 4a + 2b + c) of [W8, 2, 2, 2].
        xc0, xc1 = tl.split(tl.reshape(xs, (BLOCK_M, W8, 2, 2, 2)))
        xc0b0, xc0b1 = tl.split(xc0)
        xc1b0, xc1b1 = tl.split(xc1)
        x0, x4 = tl.split(xc0b0)
        x2, x6 = tl.split(xc0b1)
        x1, x5 = tl.split(xc1b0)
        x3, x7 = tl.split(xc1b1)
        part = tl.dot(x0, w0)
        part = tl.dot(x1, w1, part)
        part = tl.dot(x2, w2, part)
        part = tl.dot(x3, w3, part)
        part = tl.dot(x4, w4, part)
        part = tl.dot(x5, w5, part)
        part = tl.dot(x6, w6, part)
        part = tl.dot(x7, w7, part)
        acc += part * down[:, None]
    acc = acc * (tl.load(g_ptr).to(tl.float32) * 128.0)
    o_mask = m_ok[:, None] & n_ok[None, :]
    if not PARTIAL:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        tl.store(out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :],
                 acc, mask=o_mask)


@triton.jit
def _sum_partials(part, stride_os, fin, bias, b_ok, o_mask, counter, HAS_BIAS: tl.constexpr):
    # Split-K without a second kernel: the program of a tile that arrives last (one counter
    # per output tile) adds the fp32 partials of all splits in split order 0, 1, .. (the
    # order is fixed, so the sum is deterministic; which program does it is not) and
    # writes the output; it then resets the counter for the next launch.
    splits = tl.num_programs(2)
    tl.debug_barrier()  # every thread's partial is stored before the release below
    arrived = tl.atomic_add(counter, 1, sem="acq_rel")
    if arrived == splits - 1:
        tl.debug_barrier()
        total = tl.load(part, mask=o_mask, other=0.0, cache_modifier=".cg")
        for s in range(1, splits):
            # .cg: the peers' partials from L2, never a stale L1 line.
            total += tl.load(part + s * stride_os, mask=o_mask, other=0.0, cache_modifier=".cg")
        if HAS_BIAS:
            total += tl.load(bias, mask=b_ok, other=0.0).to(tl.float32)
        tl.store(fin, total.to(fin.dtype.element_ty), mask=o_mask)
        tl.atomic_xchg(counter, 0)


@triton.jit
def x_prepare(x_ptr, xs_ptr, down_ptr, K, KP, stride_xm, stride_sm,
              BLOCK_K: tl.constexpr, CHUNK: tl.constexpr):
    """One row of ``x`` per program, once per call: scaled by the power of two that puts the
    row's largest magnitude in [2^14, 2^15), converted to fp16 (exact, module doc "Prepared
    activations"), written with each K tile's columns in decode order (position
    ``j * BLOCK_K/8 + i`` holds column ``8i + j``) and zero-padded to ``KP`` (whole tiles);
    ``down_ptr[row]`` gets the inverse power of two."""
    row = tl.program_id(0)
    offs = tl.arange(0, CHUNK)
    W8: tl.constexpr = BLOCK_K // 8
    big = tl.zeros((CHUNK,), dtype=tl.float32)
    for k0 in range(0, K, CHUNK):
        v = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=k0 + offs < K, other=0.0)
        big = tl.maximum(big, tl.abs(v.to(tl.float32)))
    rmax = tl.max(big, axis=0)
    expo = (rmax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    shift = tl.minimum(tl.maximum(141 - expo, -126), 126)  # rmax * 2^shift in [2^14, 2^15)
    up = ((shift + 127) << 23).to(tl.float32, bitcast=True)
    tl.store(down_ptr + row, ((127 - shift) << 23).to(tl.float32, bitcast=True))
    for k0 in range(0, KP, CHUNK):
        p = k0 + offs
        q = p % BLOCK_K
        src = p - q + 8 * (q % W8) + q // W8
        v = tl.load(x_ptr + row * stride_xm + src, mask=src < K, other=0.0)
        tl.store(xs_ptr + row * stride_sm + p, (v.to(tl.float32) * up).to(tl.float16),
                 mask=p < KP)


@triton.jit
def nvfp4_matmul_xp(xs_ptr, down_ptr, w_ptr, s_ptr, g_ptr, b_ptr, out_ptr,
                    M, N, K, stride_xm, stride_wn, stride_sn, stride_om, stride_os,
                    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, TILES_PER_SPLIT, PARTIAL: tl.constexpr,
                    ASM: tl.constexpr, fin_ptr=None, cnt_ptr=None,
                    SUM_IN_KERNEL: tl.constexpr = False):
    """``nvfp4_matmul_w8`` on prepared activations (``x_prepare``): the 8 x slices of a tile
    are 8 contiguous loads of fp16, no per-tile scaling, splitting or conversion of x; the
    row factor ``down`` and ``weight_scale_2 * 2^7`` multiply the accumulator once."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    W8: tl.constexpr = BLOCK_K // 8
    GROUPS: tl.constexpr = BLOCK_K // 16
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, W8)
    offs_g = tl.arange(0, GROUPS)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_tiles = tl.cdiv(K, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = pid_k * TILES_PER_SPLIT
    last = tl.minimum(first + TILES_PER_SPLIT, k_tiles)
    x_rows = xs_ptr + offs_m[:, None] * stride_xm + offs_w[None, :]
    for t in range(first, last):
        kw = t * W8 + offs_w
        kg = t * GROUPS + offs_g
        words = tl.load(w_ptr + offs_n[None, :] * stride_wn + kw[:, None],
                        mask=(kw < K // 8)[:, None] & n_ok[None, :], other=0)
        s = tl.load(s_ptr + offs_n[None, :] * stride_sn + kg[:, None],
                    mask=(kg < K // 16)[:, None] & n_ok[None, :], other=0)
        sb = s.to(tl.int16)
        s16 = (((sb & 0x80) << 8) | ((sb & 0x7F) << 7)).to(tl.float16, bitcast=True) * 32768.0
        s16 = tl.reshape(tl.broadcast_to(s16[:, None, :], (GROUPS, 2, BLOCK_N)), (W8, BLOCK_N))
        if ASM:
            w0, w1, w2, w3, w4, w5, w6, w7 = tl.inline_asm_elementwise(
                _DECODE8_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r", [words, s16],
                dtype=(tl.float16,) * 8, is_pure=True, pack=2)
        else:
            w0 = _nibble16(words, 0, s16)
            w1 = _nibble16(words, 1, s16)
            w2 = _nibble16(words, 2, s16)
            w3 = _nibble16(words, 3, s16)
            w4 = _nibble16(words, 4, s16)
            w5 = _nibble16(words, 5, s16)
            w6 = _nibble16(words, 6, s16)
            w7 = _nibble16(words, 7, s16)
        xt = x_rows + t * BLOCK_K
        acc = tl.dot(tl.load(xt, mask=m_ok[:, None], other=0.0), w0, acc)
        acc = tl.dot(tl.load(xt + W8, mask=m_ok[:, None], other=0.0), w1, acc)
        acc = tl.dot(tl.load(xt + 2 * W8, mask=m_ok[:, None], other=0.0), w2, acc)
        acc = tl.dot(tl.load(xt + 3 * W8, mask=m_ok[:, None], other=0.0), w3, acc)
        acc = tl.dot(tl.load(xt + 4 * W8, mask=m_ok[:, None], other=0.0), w4, acc)
        acc = tl.dot(tl.load(xt + 5 * W8, mask=m_ok[:, None], other=0.0), w5, acc)
        acc = tl.dot(tl.load(xt + 6 * W8, mask=m_ok[:, None], other=0.0), w6, acc)
        acc = tl.dot(tl.load(xt + 7 * W8, mask=m_ok[:, None], other=0.0), w7, acc)
    down = tl.load(down_ptr + offs_m, mask=m_ok, other=0.0)
    acc = acc * (down * (tl.load(g_ptr).to(tl.float32) * 128.0))[:, None]
    o_mask = m_ok[:, None] & n_ok[None, :]
    if not PARTIAL:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        part = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(part + pid_k * stride_os, acc, mask=o_mask)
        if SUM_IN_KERNEL:
            _sum_partials(part, stride_os, fin_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
                          b_ptr + offs_n[None, :], n_ok[None, :], o_mask,
                          cnt_ptr + pid_m * tl.num_programs(0) + pid_n, HAS_BIAS)


@triton.jit
def nvfp4_matmul_xpt(xs_ptr, down_ptr, w_ptr, s_ptr, g_ptr, b_ptr, out_ptr,
                     M, N, K, stride_xm, stride_wn, stride_sn, stride_om, stride_os,
                     HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, TILES_PER_SPLIT, PARTIAL: tl.constexpr,
                     ASM: tl.constexpr, fin_ptr=None, cnt_ptr=None,
                     SUM_IN_KERNEL: tl.constexpr = False):
    """``nvfp4_matmul_xp`` with the operands swapped: ``out^T [BLOCK_N, BLOCK_M] += W x^T``,
    the decoded weight the first operand (on sm_90 the warpgroup MMA reads it from
    registers, so decoded weights never go through shared memory) and the activations the
    second (BLOCK_M is the MMA's N: 16 serves M <= 16 without padding to 64 rows)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    W8: tl.constexpr = BLOCK_K // 8
    GROUPS: tl.constexpr = BLOCK_K // 16
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, W8)
    offs_g = tl.arange(0, GROUPS)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_tiles = tl.cdiv(K, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    first = pid_k * TILES_PER_SPLIT
    last = tl.minimum(first + TILES_PER_SPLIT, k_tiles)
    x_cols = xs_ptr + offs_m[None, :] * stride_xm + offs_w[:, None]
    for t in range(first, last):
        kw = t * W8 + offs_w
        kg = t * GROUPS + offs_g
        words = tl.load(w_ptr + offs_n[:, None] * stride_wn + kw[None, :],
                        mask=n_ok[:, None] & (kw < K // 8)[None, :], other=0)
        s = tl.load(s_ptr + offs_n[:, None] * stride_sn + kg[None, :],
                    mask=n_ok[:, None] & (kg < K // 16)[None, :], other=0)
        sb = s.to(tl.int16)
        s16 = (((sb & 0x80) << 8) | ((sb & 0x7F) << 7)).to(tl.float16, bitcast=True) * 32768.0
        s16 = tl.reshape(tl.broadcast_to(s16[:, :, None], (BLOCK_N, GROUPS, 2)), (BLOCK_N, W8))
        if ASM:
            w0, w1, w2, w3, w4, w5, w6, w7 = tl.inline_asm_elementwise(
                _DECODE8_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r", [words, s16],
                dtype=(tl.float16,) * 8, is_pure=True, pack=2)
        else:
            w0 = _nibble16(words, 0, s16)
            w1 = _nibble16(words, 1, s16)
            w2 = _nibble16(words, 2, s16)
            w3 = _nibble16(words, 3, s16)
            w4 = _nibble16(words, 4, s16)
            w5 = _nibble16(words, 5, s16)
            w6 = _nibble16(words, 6, s16)
            w7 = _nibble16(words, 7, s16)
        xt = x_cols + t * BLOCK_K
        acc = tl.dot(w0, tl.load(xt, mask=m_ok[None, :], other=0.0), acc)
        acc = tl.dot(w1, tl.load(xt + W8, mask=m_ok[None, :], other=0.0), acc)
        acc = tl.dot(w2, tl.load(xt + 2 * W8, mask=m_ok[None, :], other=0.0), acc)
        acc = tl.dot(w3, tl.load(xt + 3 * W8, mask=m_ok[None, :], other=0.0), acc)
        acc = tl.dot(w4, tl.load(xt + 4 * W8, mask=m_ok[None, :], other=0.0), acc)
        acc = tl.dot(w5, tl.load(xt + 5 * W8, mask=m_ok[None, :], other=0.0), acc)
        acc = tl.dot(w6, tl.load(xt + 6 * W8, mask=m_ok[None, :], other=0.0), acc)
        acc = tl.dot(w7, tl.load(xt + 7 * W8, mask=m_ok[None, :], other=0.0), acc)
    down = tl.load(down_ptr + offs_m, mask=m_ok, other=0.0)
    acc = acc * (down * (tl.load(g_ptr).to(tl.float32) * 128.0))[None, :]
    o_mask = n_ok[:, None] & m_ok[None, :]
    if not PARTIAL:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None],
                 acc.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        part = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
        tl.store(part + pid_k * stride_os, acc, mask=o_mask)
        if SUM_IN_KERNEL:
            _sum_partials(part, stride_os, fin_ptr + offs_m[None, :] * stride_om + offs_n[:, None],
                          b_ptr + offs_n[:, None], n_ok[:, None], o_mask,
                          cnt_ptr + pid_m * tl.num_programs(0) + pid_n, HAS_BIAS)


@triton.jit
def splitk_reduce(part_ptr, b_ptr, out_ptr, MN, N, SPLIT_K,
                  HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(part_ptr + s * MN + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)

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
    blk = _scale_factor(s, tl.load(g_ptr).to(tl.float32) * 4194304.0)
    blk = tl.reshape(tl.broadcast_to(blk[:, :, None], (BLOCK_N, GROUPS, 8)),
                     (BLOCK_N, HALF))
    lo = _decode(w & 15, blk).to(out_ptr.dtype.element_ty)
    hi = _decode(w >> 4, blk).to(out_ptr.dtype.element_ty)
    # Interleave: element 2i is the low nibble of byte i.
    out = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K))
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + offs_n[:, None] * K + offs_k[None, :], out,
             mask=n_ok[:, None] & (offs_k < K)[None, :])


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


#: The mode the decorators above ran in.
_BUILT_INTERPRETED = _interpreting()


def kernels() -> Nvfp4Kernels:
    """The kernels for the current ``TRITON_INTERPRET`` setting: when it differs from the one
    this module was imported under, the module is re-executed so the decorators run again."""
    if _interpreting() != _BUILT_INTERPRETED:
        module = importlib.reload(sys.modules[__name__])
        return module.kernels()  # type: ignore[no-any-return]
    return Nvfp4Kernels(nvfp4_matmul, splitk_reduce, nvfp4_dequant, nvfp4_matmul_w8, x_prepare,
                        nvfp4_matmul_xp, nvfp4_matmul_xpt)


def _scale_bits(scales: torch.Tensor) -> torch.Tensor:
    # The kernels decode E4M3 from its bits (see the module doc).
    return scales.view(torch.uint8) if scales.dtype == torch.float8_e4m3fn else scales


def nvfp4_linear_triton(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                        global_scale: torch.Tensor, bias: torch.Tensor | None, *,
                        block_m: int, block_n: int, block_k: int, split_k: int,
                        num_warps: int = 4, num_stages: int = 3,
                        dot16: bool = False, decode8: bool = False,
                        xprep: bool = False, swap_ab: bool = False,
                        sum_in_kernel: bool = False) -> torch.Tensor:
    """``x [M, K] @ dequant(packed, scales, global_scale)^T (+ bias)`` -> [M, N] in x's dtype.

    ``x`` must be contiguous along K; ``block_k`` a multiple of 32 (two dots of K/2 >= 16),
    ``block_m``/``block_n`` at least 16. ``split_k`` > 1 writes fp32 partials and reduces.
    """
    m, k = x.shape
    n = packed.shape[0]
    scales = _scale_bits(scales)
    k_tiles = -(-k // block_k)
    split_k = max(1, min(split_k, k_tiles))
    per_split = -(-k_tiles // split_k)
    split_k = -(-k_tiles // per_split)  # no empty splits
    ks = kernels()
    interp = _interpreting()
    if xprep:
        if block_k not in (128, 256, 512):
            raise ValueError(f"nvfp4-triton: block_k={block_k} with xprep; valid: 128, 256, "
                             "512 (8 dots of block_k / 8 >= 16 columns)")
        return _linear_xp(ks, x, packed, scales, global_scale, bias, block_m, block_n, block_k,
                          split_k, per_split, asm=x.is_cuda and not interp and
                          torch.version.hip is None, num_warps=num_warps,
                          num_stages=num_stages, swap_ab=swap_ab,
                          sum_in_kernel=sum_in_kernel)
    if decode8 and k % 8 == 0:
        return _linear_w8(ks, x, packed, scales, global_scale, bias, block_m, block_n, block_k,
                          split_k, per_split, asm=x.is_cuda and not interp and
                          torch.version.hip is None, num_warps=num_warps,
                          num_stages=num_stages)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    has_bias = bias is not None
    bias_arg = bias if bias is not None else out
    grid = (-(-n // block_n), -(-m // block_m), split_k)
    opts: dict[str, Any] = {}
    if x.is_cuda:
        opts = {"num_warps": num_warps, "num_stages": num_stages}
    if split_k == 1:
        ks.matmul[grid](x, packed, scales, global_scale, bias_arg, out, m, n, k,
                        x.stride(0), packed.stride(0), scales.stride(0), out.stride(0), 0,
                        HAS_BIAS=has_bias, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                        TILES_PER_SPLIT=per_split, PARTIAL=False, DOT_FP32=interp, DOT16=dot16,
                        **opts)
        return out
    part = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    ks.matmul[grid](x, packed, scales, global_scale, bias_arg, part, m, n, k,
                    x.stride(0), packed.stride(0), scales.stride(0), n, m * n,
                    HAS_BIAS=False, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                    TILES_PER_SPLIT=per_split, PARTIAL=True, DOT_FP32=interp, DOT16=dot16,
                    **opts)
    block = 1024
    ks.reduce[(-(-(m * n) // block),)](part, bias_arg, out, m * n, n, SPLIT_K=split_k,
                                       HAS_BIAS=has_bias, BLOCK=block)
    return out


def _linear_w8(ks: Nvfp4Kernels, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
               global_scale: torch.Tensor, bias: torch.Tensor | None, block_m: int,
               block_n: int, block_k: int, split_k: int, per_split: int, *, asm: bool,
               num_warps: int, num_stages: int) -> torch.Tensor:
    m, k = x.shape
    n = packed.shape[0]
    words = packed.view(torch.int32)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bias_arg = bias if bias is not None else out
    grid = (-(-n // block_n), -(-m // block_m), split_k)
    opts: dict[str, Any] = {"num_warps": num_warps, "num_stages": num_stages} if x.is_cuda else {}
    common = dict(HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
                  BLOCK_K=block_k, ASM=asm, **opts)
    if split_k == 1:
        ks.matmul_w8[grid](x, words, scales, global_scale, bias_arg, out, m, n, k, x.stride(0),
                           words.stride(0), scales.stride(0), out.stride(0), 0,
                           TILES_PER_SPLIT=per_split, PARTIAL=False, **common)
        return out
    part = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    common["HAS_BIAS"] = False
    ks.matmul_w8[grid](x, words, scales, global_scale, bias_arg, part, m, n, k, x.stride(0),
                       words.stride(0), scales.stride(0), n, m * n,
                       TILES_PER_SPLIT=per_split, PARTIAL=True, **common)
    block = 1024
    ks.reduce[(-(-(m * n) // block),)](part, bias_arg, out, m * n, n, SPLIT_K=split_k,
                                       HAS_BIAS=bias is not None, BLOCK=block)
    return out


#: Per device: int32 counters, one per output tile, for split-K summed in the kernel. Every
#: launch leaves them at zero; launches that overlap on different streams must not share
#: them, so ``sum_in_kernel`` is for one stream per device (the engine's case).
_COUNTERS: dict[str, torch.Tensor] = {}


def _tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    have = _COUNTERS.get(str(device))
    if have is None or have.numel() < tiles:
        have = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
        _COUNTERS[str(device)] = have
    return have


def prepare_x(x: torch.Tensor, block_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` as the ``xprep`` kernel reads it: fp16 [M, K rounded up to ``block_k``],
    each row times a power of two, columns of each K tile in decode order; and the per-row
    inverse powers of two (fp32 [M])."""
    m, k = x.shape
    kp = -(-k // block_k) * block_k
    xs = torch.empty(m, kp, dtype=torch.float16, device=x.device)
    down = torch.empty(m, dtype=torch.float32, device=x.device)
    chunk = max(block_k, min(2048, triton.next_power_of_2(kp)))
    kernels().x_prepare[(m,)](x, xs, down, k, kp, x.stride(0), xs.stride(0),
                              BLOCK_K=block_k, CHUNK=chunk)
    return xs, down


def _linear_xp(ks: Nvfp4Kernels, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
               global_scale: torch.Tensor, bias: torch.Tensor | None, block_m: int,
               block_n: int, block_k: int, split_k: int, per_split: int, *, asm: bool,
               num_warps: int, num_stages: int, swap_ab: bool,
               sum_in_kernel: bool) -> torch.Tensor:
    m, k = x.shape
    n = packed.shape[0]
    xs, down = prepare_x(x, block_k)
    kernel = ks.matmul_xpt if swap_ab else ks.matmul_xp
    words = packed.view(torch.int32)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bias_arg = bias if bias is not None else out
    grid = (-(-n // block_n), -(-m // block_m), split_k)
    opts: dict[str, Any] = {"num_warps": num_warps, "num_stages": num_stages} if x.is_cuda else {}
    common = dict(HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
                  BLOCK_K=block_k, ASM=asm, **opts)
    if split_k == 1:
        kernel[grid](xs, down, words, scales, global_scale, bias_arg, out, m, n, k,
                     xs.stride(0), words.stride(0), scales.stride(0), out.stride(0), 0,
                     TILES_PER_SPLIT=per_split, PARTIAL=False, **common)
        return out
    part = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    if sum_in_kernel:
        kernel[grid](xs, down, words, scales, global_scale, bias_arg, part, m, n, k,
                     xs.stride(0), words.stride(0), scales.stride(0), n, m * n,
                     TILES_PER_SPLIT=per_split, PARTIAL=True, fin_ptr=out,
                     cnt_ptr=_tile_counters(x.device, grid[0] * grid[1]), SUM_IN_KERNEL=True,
                     **common)
        return out
    common["HAS_BIAS"] = False
    kernel[grid](xs, down, words, scales, global_scale, bias_arg, part, m, n, k,
                 xs.stride(0), words.stride(0), scales.stride(0), n, m * n,
                 TILES_PER_SPLIT=per_split, PARTIAL=True, **common)
    block = 1024
    ks.reduce[(-(-(m * n) // block),)](part, bias_arg, out, m * n, n, SPLIT_K=split_k,
                                       HAS_BIAS=bias is not None, BLOCK=block)
    return out


def dequantize_nvfp4_triton(packed: torch.Tensor, scales: torch.Tensor,
                            global_scale: torch.Tensor, dtype: torch.dtype,
                            out: torch.Tensor | None = None, *, block_n: int = 32,
                            block_k: int = 256) -> torch.Tensor:
    """The dense [N, K] weight in ``dtype`` (into ``out`` when given, e.g. a reused
    temporary): the reference's float32 values cast to ``dtype``, bit for bit."""
    n, k = packed.shape[0], 2 * packed.shape[1]
    scales = _scale_bits(scales)
    if out is None:
        out = torch.empty(n, k, dtype=dtype, device=packed.device)
    grid = (-(-n // block_n), -(-k // block_k))
    kernels().dequant[grid](packed, scales, global_scale, out, n, k,
                            BLOCK_N=block_n, BLOCK_K=block_k)
    return out
