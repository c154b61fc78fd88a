# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# (Triton kernels are written in its untyped DSL; the Python wrappers are typed.)
"""The fused kernel of ``nvfp4-triton``: the packed weight decoded straight into the
``tl.dot`` operand layout as exact bf16, with the activations used as they come (bf16/fp16,
no preparation pass), in four weight readings:

* ``pf-*`` (``SWAP``, the defaults): the repacked words in the ``"fragment"`` K order with
  scale codes (``scale_codes``), decoded by ``decode_fragment`` straight into the registers
  of the dot's first operand, the product computed transposed (``out^T = W x^T``; on sm_90
  the weight is the register operand of the wgmma and the activations its shared-memory
  operand, as loaded);
* ``pr-*`` (``REPACKED``): the repacked int32 words [N, K/8] of
  ``kernelbay.formats.repack_e2m1_words`` in the natural K order, decoded by
  ``decode_words(REPACKED=True)``;
* ``hw-*``: the checkpoint layout (``packed`` uint8 [N, K/2] viewed as int16 [N, K/4]:
  halfword ``j`` holds elements ``4j .. 4j+3`` in nibbles 0..3, little-endian);
* ``pw-*`` (``PAIRS``): the same bytes as int32 words of eight codes, elements k and k + 4 of
  a word decoded in one register (``decode_words``), the activation tile permuted to match.

E4M3 block scales as bytes [N, K/16], fp32 ``weight_scale_2``.

Decode of one element (code ``c = s e1 e0 m``, block scale ``S``), halfword reading (the
repacked one stores the bits where the second step wants them, so it does that step's
mask and shift, ``kernelbay.formats.e2m1_words_triton``, and the multiply):

* The codes are split out of the halfwords by three shifts and two ``tl.join`` (each lane's
  code in bits 12..15, lower bits ignored). The joined dimensions are ones the MMA operand
  layout keeps within a thread, so the decoded tile needs no layout conversion; an
  ``arange`` of shift amounts or a third join would make the compiler decode in a blocked
  layout and move the tile through shared memory.
* PTX on two 16-bit lanes per 32-bit register: ``and`` keeps bits 12..15, a shift by 6 and
  one ``lop3`` place the sign at bit 15 and ``e1 e0 m`` at bits 8..6, which as bf16 reads
  ``e2m1(c) * 2^-126`` (code 1 is the subnormal 2^-127). One packed ``fma.rn.bf16x2`` by
  ``S * 2^118`` (a normal bf16 for every finite E4M3 ``S``: 2^-9 .. 448, so at most
  448 * 2^118 < 2^127) plus ``-0`` gives ``e2m1(c) * S * 2^-8``. That product has at most
  2 + 4 significant bits and lies in [2^-18, 10.5] (multiples of 2^-18), so it is exact in
  bf16, and also in fp16 (subnormal step 2^-24), so fp16 activations take the decoded tile
  through one exact conversion. Signed zeros come out as in the reference.
* ``weight_scale_2 * 2^8`` multiplies the fp32 accumulator once per output tile, so the
  products in the dot are those of the exact dequantized weight (``e2m1 * S`` is exact in
  float32 in the reference too) and only ``* weight_scale_2`` is rounded at another place.

The multiplier per 16-element block is computed from the E4M3 bits once per block: fp16 bits
``(b & 0x80) << 8 | (b & 0x7F) << 7`` are ``S * 2^-8`` for normals and subnormals alike,
widened to fp32, times 2^126, rounded to bf16 (exact).

Plain Triton path (the interpreter, ROCm): per element the fp16 bits ``(c & 8) << 12 |
(c & 7) << 9`` (``e2m1 * 2^-14``) widened to fp32 times ``S * 2^6``: the same values, kept
in fp32 under the interpreter (its bf16 conversion truncates and flushes subnormals).

M <= 16 runs 16-row tiles over many N tiles with split-K (fp32 partials, summed in split
order by ``triton_kernels.splitk_reduce``); larger M uses larger row tiles. Loads
(``_load_k_tile``), the E2M1/E4M3 plain decodes and the epilogue (``triton_kernels.store_tile``)
are shared helpers.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import torch
import triton
import triton.language as tl
from kernelbay import triton_pdl
from kernelbay.formats import e2m1_words_triton
from kernelbay.formats.e2m1_words_triton import (
    MULTIPLY_LANES_PTX,
    fragment_tile,
    fragment_to_k,
    repacked_codes,
    repacked_lanes,
    repacked_lanes16,
    weight_dot,
)
from kernelbay.triton_pdl import grid_release, grid_wait

from kernelbay_quant_nvfp4.cuda_gemv import stored_rows
from kernelbay_quant_nvfp4.triton_kernels import (
    e2m1_2m14,
    e4m3_2m8,
    interpreting,
    kernels,
    ptx_decodes,
    scale_bits,
    split_plan,
    store_tile,
    sum_partials,
)

__all__ = ["decode_words", "hw_kernel", "nvfp4_linear_hw"]

# Two elements per 32-bit register (pack=2 of 16-bit operands): $0 the two bf16 results, $1
# the two codes (bits 12..15 of each half), $2 the two multipliers S * 2^118 (bf16 bits).
# lop3 0xA8 is (a | b) & c: the sign from a (bit 15 of each half), e1 e0 m from b = a >> 6
# (bits 8..6); a's bits there are zero after the and, and b's high-half bits shifted into
# the low half land outside the mask. Adding -0 keeps the sign of zero products.
_DECODE_PTX = tl.constexpr("""{
.reg .b32 a, b, v, nz;
mov.b32 nz, 0x80008000;
and.b32 a, $1, 0xF000F000;
shr.b32 b, a, 6;
lop3.b32 v, a, b, 0x81C081C0, 0xA8;
fma.rn.bf16x2 $0, v, $2, nz;
}""")


@triton.jit
def _block_multipliers(s, R: tl.constexpr, G: tl.constexpr, BK: tl.constexpr):
    """fp32 ``S * 2^-8`` [R, G] -> the bf16 bits of ``S * 2^118`` per element [R, BK] (each
    16-element block's multiplier, exact: a normal bf16 for every finite E4M3 ``S``)."""
    mult = (s * 8.507059173023462e37).to(tl.bfloat16).to(tl.int16, bitcast=True)
    return tl.reshape(tl.broadcast_to(mult[:, :, None], (R, G, 16)), (R, BK))


@triton.jit
def _codes_in_dot_order(halves, R: tl.constexpr, KH: tl.constexpr):
    """int16 halfwords [R, KH] -> uint16 [R, 4 KH], element k's code in bits 12..15."""
    h = halves.to(tl.uint16, bitcast=True)
    even = tl.join(h << 12, h << 4)  # elements 0 and 2 of each halfword
    odd = tl.join(h << 8, h)  # elements 1 and 3
    return tl.reshape(tl.join(even, odd), (R, KH * 4))


@triton.jit
def decode_halfwords(halves, sbits, R: tl.constexpr, KH: tl.constexpr, ASM: tl.constexpr):
    """``halves`` int16 [R, KH] and E4M3 bytes [R, KH // 4] -> ``e2m1 * S * 2^-8`` [R, 4 KH]
    in K order: bf16 (``ASM``) or fp32 holding the same values (plain)."""
    BK: tl.constexpr = KH * 4
    G: tl.constexpr = KH // 4
    s = e4m3_2m8(sbits)
    if ASM:
        mult = _block_multipliers(s, R, G, BK)
        codes = _codes_in_dot_order(halves, R, KH)
        out = tl.inline_asm_elementwise(_DECODE_PTX, "=r,r,r", [codes, mult],
                                        dtype=tl.bfloat16, is_pure=True, pack=2)
    else:
        shifts = tl.arange(0, 4) * 4
        nib = ((halves.to(tl.int32) & 0xFFFF)[:, :, None] >> shifts[None, None, :]) & 15
        s = tl.reshape(tl.broadcast_to((s * 16384.0)[:, :, None], (R, G, 16)), (R, BK))
        out = e2m1_2m14(tl.reshape(nib, (R, BK))) * s
    return out


@triton.jit
def decode_words(words, sbits, R: tl.constexpr, KQ: tl.constexpr, ASM: tl.constexpr,
                 REPACKED: tl.constexpr):
    """``words`` int32 [R, KQ] (eight codes each) and E4M3 bytes [R, KQ // 2] ->
    ``e2m1 * S * 2^-8`` [R, 8 KQ]: bf16 (``ASM``) or fp32 holding the same values (plain).

    ``REPACKED``: the words of ``kernelbay.formats.repack_e2m1_words``, decoded in the natural
    K order by ``repacked_lanes16`` (one mask, or a rotation and a mask, per two elements for
    elements 0..5; a mask, a multiply and a mask for 6..7) and one packed multiply (the
    ``pr-*`` kernels: 4.2-4.7 SASS instructions per element in the K loop of the 16-row
    tiles, with the previous word layout).

    Otherwise the checkpoint's bytes read four at a time (element ``j`` in nibble ``j``),
    each word's elements in ``PAIR_ORDER`` (0, 4, 1, 5, 2, 6, 3, 7): one 32-bit shift puts
    element j's code in bits 12..15 and element j + 4's in bits 28..31, the two lanes of
    ``_DECODE_PTX``, so no 16-bit codes are packed into registers first (the ``pw-*``
    kernels: 4.8 SASS instructions per element in the K loop of a 16 x 64 x 256 tile against
    6.2 for the halfword decode). The caller permutes its activation tile to the same order."""
    BK: tl.constexpr = KQ * 8
    G: tl.constexpr = KQ // 2
    s = e4m3_2m8(sbits)
    u = words.to(tl.uint32, bitcast=True)
    if ASM:
        mult = _block_multipliers(s, R, G, BK)
        if REPACKED:
            lanes = repacked_lanes16(u, R, KQ)
        else:
            # [R, KQ, 2, 2] over j = 0..3 (two joins: dimensions the MMA layout keeps in
            # registers)
            regs = tl.reshape(tl.join(tl.join(u << 12, u << 4), tl.join(u << 8, u)),
                              (R, KQ * 4))
            lanes = tl.reshape(tl.join(regs.to(tl.uint16), (regs >> 16).to(tl.uint16)),
                               (R, BK))
        if REPACKED:
            out = tl.inline_asm_elementwise(MULTIPLY_LANES_PTX, "=r,r,r", [lanes, mult],
                                            dtype=tl.bfloat16, is_pure=True, pack=2)
        else:
            out = tl.inline_asm_elementwise(_DECODE_PTX, "=r,r,r", [lanes, mult],
                                            dtype=tl.bfloat16, is_pure=True, pack=2)
    else:
        if REPACKED:
            nib = repacked_codes(u)
        else:
            pos = tl.arange(0, 8)
            shifts = (pos // 2) * 4 + (pos % 2) * 16  # PAIR_ORDER: nibble j, then j + 4
            nib = (u[:, :, None] >> shifts[None, None, :].to(tl.uint32)) & 15
        s = tl.reshape(tl.broadcast_to((s * 16384.0)[:, :, None], (R, G, 16)), (R, BK))
        out = e2m1_2m14(tl.reshape(nib, (R, BK))) * s
    return out


# The multipliers of two blocks side by side (scale_codes: code r -> bf16 bits r * 16 + 0x7600):
# four codes $4 (bytes 0..3, pack=4) give the pair of codes 0 and 1 in $0 and of codes 2 and 3
# in $2 ($1 and $3 repeat them; the caller keeps the even elements). One byte permute and one
# multiply-add per two blocks, where making each multiplier took one of each.
_CODE_PAIRS_PTX = tl.constexpr("""{
.reg .b32 t;
prmt.b32 t, $4, 0, 0x4140;
mad.lo.u32 $0, t, 16, 0x76007600;
prmt.b32 t, $4, 0, 0x4342;
mad.lo.u32 $2, t, 16, 0x76007600;
mov.b32 $1, $0;
mov.b32 $3, $2;
}""")


def _pair_scale_ptx(half: str) -> str:
    """PTX: one packed multiply of a repacked register's two lanes ($1: bf16 bits of
    e2m1 * 2^-126) by half ``half`` ("l" or "h") of a multiplier pair ($2), broadcast to both
    lanes (ptxas makes the broadcast an operand swizzle of the multiply, no instruction);
    adding -0 keeps signed zeros."""
    return f"""{{
.reg .b16 l, h;
.reg .b32 m, nz;
mov.b32 {{l, h}}, $2;
mov.b32 m, {{{half}, {half}}};
mov.b32 nz, 0x80008000;
fma.rn.bf16x2 $0, $1, m, nz;
}}"""


_PAIR_LO_SCALE_PTX = tl.constexpr(_pair_scale_ptx("l"))
_PAIR_HI_SCALE_PTX = tl.constexpr(_pair_scale_ptx("h"))


@triton.jit
def decode_fragment(words, codes, R: tl.constexpr, KQ: tl.constexpr, ASM: tl.constexpr):
    """``"fragment"``-order repacked words int32 [R, KQ] and scale codes uint8 [R, KQ // 4]
    (``scale_codes``: signs and zeros folded into the words) -> ``e2m1 * S * 2^-8`` [R, 8 KQ]
    in K order: bf16 (``ASM``) or fp32 holding the same values (plain).

    Word ``4 b + c`` holds four elements of block ``2 b`` (registers 0, 1 of
    ``repacked_lanes``) and four of block ``2 b + 1`` (registers 2, 3). The two blocks'
    multipliers are made side by side in one register (``_CODE_PAIRS_PTX``: a byte permute
    and a multiply-add per two blocks), each register is multiplied as a 32-bit value by the
    half of its block, and the lanes are split into bf16 elements only at the end."""
    BK: tl.constexpr = KQ * 8
    B: tl.constexpr = KQ // 4
    u = words.to(tl.uint32, bitcast=True)
    if ASM:
        r0, r1, r2, r3 = repacked_lanes(u)
        pairs = tl.inline_asm_elementwise(_CODE_PAIRS_PTX, "=r,=r,=r,=r,r", [codes],
                                          dtype=tl.uint32, is_pure=True, pack=4)
        pair, _ = tl.split(tl.reshape(pairs, (R, B, 2)))  # blocks 2b and 2b + 1
        m = tl.reshape(tl.broadcast_to(pair[:, :, None], (R, B, 4)), (R, KQ))
        v0 = tl.inline_asm_elementwise(_PAIR_LO_SCALE_PTX, "=r,r,r", [r0, m],
                                       dtype=tl.uint32, is_pure=True, pack=1)
        v1 = tl.inline_asm_elementwise(_PAIR_LO_SCALE_PTX, "=r,r,r", [r1, m],
                                       dtype=tl.uint32, is_pure=True, pack=1)
        v2 = tl.inline_asm_elementwise(_PAIR_HI_SCALE_PTX, "=r,r,r", [r2, m],
                                       dtype=tl.uint32, is_pure=True, pack=1)
        v3 = tl.inline_asm_elementwise(_PAIR_HI_SCALE_PTX, "=r,r,r", [r3, m],
                                       dtype=tl.uint32, is_pure=True, pack=1)
        out = fragment_tile(v0, v1, v2, v3, R, KQ)
    else:
        nib = tl.reshape(repacked_codes(u), (R, BK))
        bits = (codes.to(tl.int32) * 16 + 0x7600).to(tl.int16).to(tl.bfloat16, bitcast=True)
        s = bits.to(tl.float32) * 1.1754943508222875e-38  # S * 2^-8 = multiplier * 2^-126
        # per position: word 4 b + c's elements 0..3 in block 2 b, 4..7 in block 2 b + 1
        s = tl.reshape(tl.broadcast_to(tl.reshape(s * 16384.0, (R, B, 1, 2, 1)),
                                       (R, B, 4, 2, 4)), (R, BK))
        out = fragment_to_k(e2m1_2m14(nib) * s, R, BK)
    return out


@triton.jit
def _load_k_tile(rows, cols, row_ok, limit, EVEN_K: tl.constexpr):
    """The tile ``rows[:, None] + cols[None, :]`` (zero outside ``row_ok`` and, unless
    ``EVEN_K`` says every K tile is whole, at ``cols >= limit``)."""
    mask = row_ok[:, None]
    if not EVEN_K:
        mask = mask & (cols < limit)[None, :]
    return tl.load(rows + cols[None, :], mask=mask, other=0)


@triton.jit
def _load_tiled(rows, first, WIDTH: tl.constexpr, PER_CHUNK: tl.constexpr,
                CHUNK: tl.constexpr, row_ok, limit, EVEN_K: tl.constexpr):
    """``_load_k_tile`` for the tiles layout: columns ``first .. first + WIDTH`` of rows
    ``rows``, where a row holds ``PER_CHUNK`` consecutive columns per chunk and chunks are
    ``CHUNK`` apart. A 2-D tile like the fragment layout's (so the compiler stages it in
    shared memory the same way), with the runs of consecutive, aligned columns declared so
    that the copies are 16-byte vectors."""
    RUN: tl.constexpr = PER_CHUNK if WIDTH > PER_CHUNK else WIDTH
    cols = first + tl.arange(0, WIDTH)
    offsets = (cols // PER_CHUNK) * CHUNK + cols % PER_CHUNK
    offsets = tl.max_contiguous(tl.multiple_of(offsets, RUN), RUN)
    mask = row_ok[:, None]
    if not EVEN_K:
        mask = mask & (cols < limit)[None, :]
    return tl.load(rows + offsets[None, :], mask=mask, other=0)


@triton.jit
def stored_weight_rows(w_ptr, s_ptr, rn, K, stride_wn, stride_sn, TILED: tl.constexpr):
    """Pointers to the start of rows ``rn`` of a stored weight's words and scales (64-bit:
    N * K / 4 may pass 2^31 for large layers)."""
    if TILED:
        # The tiles layout (SWAP only): row n's words of chunk j (128 elements) at
        # ((n // 16 * K / 128 + j) * 2 + n // 8 % 2) * 128 + n % 8 * 16, its codes at half that
        # offset; word q of the row is in chunk q // 16, at q % 16 (code b: b // 8, b % 8).
        tile = (rn // 16).to(tl.int64) * (K // 128) * 2 + (rn // 8) % 2
        w_rows = w_ptr + (tile * 128 + (rn % 8) * 16)[:, None]
        s_rows = s_ptr + (tile * 64 + (rn % 8) * 8)[:, None]
    else:
        w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
        s_rows = s_ptr + rn.to(tl.int64)[:, None] * stride_sn
    return w_rows, s_rows


@triton.jit
def weight_k_loop(acc, x_rows, w_rows, s_rows, m_ok, n_ok, K, first, last,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  EVEN_K: tl.constexpr, ASM: tl.constexpr, INTERPRET: tl.constexpr,
                  PAIRS: tl.constexpr, REPACKED: tl.constexpr, SWAP: tl.constexpr,
                  TILED: tl.constexpr):
    """``acc`` plus the product of K tiles ``first .. last`` of the activation rows
    ``x_rows`` and the weight rows ``w_rows`` / ``s_rows`` (``stored_weight_rows``), each
    weight tile decoded in registers as its layout says; ``acc`` [BLOCK_N, BLOCK_M] with
    ``SWAP``, else [BLOCK_M, BLOCK_N]."""
    KH: tl.constexpr = BLOCK_K // 4
    KQ: tl.constexpr = BLOCK_K // 8
    G: tl.constexpr = BLOCK_K // 16
    rw = tl.arange(0, KH)
    rq = tl.arange(0, KQ)
    rg = tl.arange(0, G)
    rk = tl.arange(0, BLOCK_K)
    # the last split may be shorter: its loop stops at the last K tile (no masks needed)
    for t in range(first, last):
        if TILED:
            packed = _load_tiled(w_rows, t * KQ, KQ, 16, 256, n_ok, K // 8, EVEN_K)
            sb = _load_tiled(s_rows, t * G, G, 8, 128, n_ok, K // 16, EVEN_K)
        else:
            if PAIRS or REPACKED:
                packed = _load_k_tile(w_rows, t * KQ + rq, n_ok, K // 8, EVEN_K)
            else:
                packed = _load_k_tile(w_rows, t * KH + rw, n_ok, K // 4, EVEN_K)
            sb = _load_k_tile(s_rows, t * G + rg, n_ok, K // 16, EVEN_K)
        xa = _load_k_tile(x_rows, t * BLOCK_K + rk, m_ok, K, EVEN_K)
        if SWAP:
            w = decode_fragment(packed, sb, BLOCK_N, KQ, ASM)
        elif PAIRS or REPACKED:
            w = decode_words(packed, sb, BLOCK_N, KQ, ASM, REPACKED)
            if not REPACKED:  # the activations in PAIR_ORDER (a permutation in registers)
                xa = tl.reshape(tl.permute(tl.reshape(xa, (BLOCK_M, KQ, 2, 4)), (0, 1, 3, 2)),
                                (BLOCK_M, BLOCK_K))
        else:
            w = decode_halfwords(packed, sb, BLOCK_N, KH, ASM)
        acc = weight_dot(xa, w, acc, SWAP, INTERPRET)
    return acc


@triton.jit
def nvfp4_matmul_hw(x_ptr, w_ptr, s_ptr, g_ptr, b_ptr, out_ptr, M, N, K,
                    stride_xm, stride_wn, stride_sn, stride_om, stride_os,
                    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, TILES_PER_SPLIT, PARTIAL: tl.constexpr,
                    EVEN_K: tl.constexpr, ASM: tl.constexpr, INTERPRET: tl.constexpr,
                    PAIRS: tl.constexpr, REPACKED: tl.constexpr = False,
                    SWAP: tl.constexpr = False, TILED: tl.constexpr = False,
                    PDL: tl.constexpr = False):
    # w_ptr: int16 halfwords [N, K/4], or int32 words [N, K/8] with PAIRS or REPACKED (the
    # repacked layout; with SWAP in the fragment order); s_ptr: E4M3 bytes [N, K/16] (scale
    # codes with SWAP); out_ptr: [M, N] or, with PARTIAL, fp32 [split, M, N] (stride_os
    # apart). SWAP accumulates the transposed tile [BLOCK_N, BLOCK_M]. PDL
    # (kernelbay.triton_pdl): a programmatic launch, which reads and writes nothing before
    # grid_wait and lets the next launch start once its K loop is done.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    w_rows, s_rows = stored_weight_rows(w_ptr, s_ptr, rn, K, stride_wn, stride_sn, TILED)
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = pid_k * TILES_PER_SPLIT
    last = tl.minimum(first + TILES_PER_SPLIT, tl.cdiv(K, BLOCK_K))
    if PDL:
        grid_wait()
    acc = weight_k_loop(acc, x_rows, w_rows, s_rows, m_ok, n_ok, K, first, last, BLOCK_M,
                        BLOCK_N, BLOCK_K, EVEN_K, ASM, INTERPRET, PAIRS, REPACKED, SWAP, TILED)
    if PDL:
        grid_release()
    if SWAP:
        acc = tl.trans(acc)
    acc = acc * (tl.load(g_ptr).to(tl.float32) * 256.0)
    store_tile(acc, out_ptr, b_ptr, rm, rn, m_ok, n_ok, stride_om,
               pid_k.to(tl.int64) * stride_os, HAS_BIAS, PARTIAL)


#: The mode the decorators above ran in.
_BUILT_INTERPRETED = interpreting()


def hw_kernel() -> Any:
    """The jitted ``nvfp4_matmul_hw`` for the current ``TRITON_INTERPRET`` setting: when it
    changed since this module was imported, ``triton_kernels`` and the core's
    ``e2m1_words_triton`` (whose helpers the kernel calls) and then this module are
    re-executed, so the decorators run in the current mode."""
    if interpreting() != _BUILT_INTERPRETED:
        kernels()  # re-executes triton_pdl too, when it re-executes triton_kernels
        importlib.reload(e2m1_words_triton)
        return importlib.reload(sys.modules[__name__]).hw_kernel()
    return nvfp4_matmul_hw


def nvfp4_linear_hw(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                    global_scale: torch.Tensor, bias: torch.Tensor | None, *, block_m: int,
                    block_n: int, block_k: int, split_k: int, num_warps: int,
                    num_stages: int, pairs: bool = False, repacked: bool = False,
                    fragment: bool = False, tiled: bool = False) -> torch.Tensor:
    """``x [M, K] @ dequant(packed, scales, global_scale)^T (+ bias)`` -> [M, N] in x's dtype
    through ``nvfp4_matmul_hw``. ``block_k``: a power of two >= 64; ``split_k`` > 1 writes
    fp32 partials summed in split order; ``pairs``: the weight read as 32-bit words and
    decoded by ``decode_words`` (K is a multiple of 16, so rows are whole words);
    ``repacked``: ``packed`` is ``kernelbay.formats.repack_e2m1_words``' int32 words, decoded by
    ``decode_words(REPACKED=True)``; ``fragment``: the same words in the ``"fragment"`` K order
    (int32 [N, K/32, 4], ``linear_triton.layout_weight``), the product computed transposed
    (``SWAP``: the decoded weight is the register operand of the dot, ``block_n`` >= 64 on
    sm_90 for ``wgmma``); ``tiled``: the same words and codes in the ``tiles`` layout
    (``linear_triton.tiles_of_fragment``: [N/16, K/128, 256] and [N/16, K/128, 128]).
    Where ``kernelbay.triton_pdl.enabled`` says so, the kernel and its split-K sum wait and
    release; in a CUDA graph the kernel becomes a programmatic dependent of a releasing kernel
    of ours right before it, the sum never (``triton_pdl.dependent``)."""
    if block_k < 64 or block_k & (block_k - 1):
        raise ValueError(f"nvfp4-triton: block_k={block_k} for the halfword kernel; valid: a "
                         "power of two >= 64 (whole 16-element blocks, dots of >= 16)")
    m, k = x.shape
    n = stored_rows(packed, tiled)
    if tiled:
        fragment = True
        words = packed
    elif fragment:
        words = packed.reshape(packed.shape[0], -1)
    else:
        words = packed if repacked else packed.view(torch.int32 if pairs else torch.int16)
    sbits = scale_bits(scales)
    k_tiles = -(-k // block_k)
    split_k, per_split = split_plan(k_tiles, split_k)
    interp = interpreting()
    asm = ptx_decodes(x)
    even = k % block_k == 0  # whole K tiles; a shorter last split stops early
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    partial = split_k > 1
    dest = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device) if partial else out
    grid = (-(-n // block_n), -(-m // block_m), split_k)
    opts: dict[str, Any] = {"num_warps": num_warps, "num_stages": num_stages} if x.is_cuda else {}
    pdl = triton_pdl.enabled(x.device)
    with triton_pdl.dependent(x.device, pdl):
        hw_kernel()[grid](x, words, sbits, global_scale, bias if bias is not None else out,
                          dest, m, n, k, x.stride(0), words.stride(0), sbits.stride(0),
                          dest.stride(-2), m * n if partial else 0,
                          HAS_BIAS=bias is not None and not partial, BLOCK_M=block_m,
                          BLOCK_N=block_n, BLOCK_K=block_k, TILES_PER_SPLIT=per_split,
                          PARTIAL=partial, EVEN_K=even, ASM=asm, INTERPRET=interp, PAIRS=pairs,
                          REPACKED=repacked or fragment, SWAP=fragment, TILED=tiled, PDL=pdl,
                          **opts)
    return sum_partials(dest, bias, out, pdl=pdl) if partial else out
