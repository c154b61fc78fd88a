# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# (Triton kernels are written in its untyped DSL.)
"""Triton building blocks of the repacked E2M1 word layout (``e2m1_words``), shared by the
FP4 plugins' kernels so that one table and one decode exist. Imports triton: only kernel
modules import this, when a backend is built (never ``kernelbay`` or ``kernelbay.formats``).

* ``repacked_lanes(u)``: the GPU decode's integer part. From uint32 words, the four 32-bit
  registers whose two 16-bit lanes read as bf16 ``e2m1 * 2^-126`` (sign at bit 15,
  ``e1 e0 m`` at bits 8..6; code 1 is the subnormal 2^-127): element ``2r + h`` of a word in
  register ``r``, half ``h``. Registers 0..2 are the word rotated left by ``LANE_ROTATIONS``
  under one mask, register 3 gathers the leftover bits with one multiply (``e2m1_words``). A
  packed bf16 multiply by the block scale (times 2^126 and whatever power of two the caller
  folds in) finishes the decode.
* ``fragment_to_k(w, R, BK)``: a tile decoded from ``"fragment"``-order words, relabelled to
  K order (no data moves when it feeds an sm_90 ``wgmma`` as the register operand);
  ``fragment_tile`` does the same from the four scaled registers of ``repacked_lanes``;
  ``weight_dot`` is the K-tile product of a decoded weight tile in either orientation.
* ``repacked_codes(u)``: the portable decode's codes, [R, KQ] words -> [R, KQ, 8] nibbles in
  K order, each bit read from ``word_bit_positions``' place (for the interpreter and ROCm).

A kernel that switches ``TRITON_INTERPRET`` inside one process must re-import this module too
(``triton.jit`` decides the mode when the decorator runs).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernelbay.formats.e2m1_words import (
    GATHER_MASK,
    GATHER_MULTIPLIER,
    LANE_MASK,
    LANE_ROTATIONS,
    word_bit_positions,
)

__all__ = ["MULTIPLY_LANES_PTX", "fragment_tile", "fragment_to_k", "repacked_codes",
           "repacked_lanes", "repacked_lanes16", "weight_dot"]

#: The PTX that finishes a repacked decode (``tl.inline_asm_elementwise``, ``"=r,r,r"``): two
#: bf16 lanes of ``repacked_lanes`` ($1) times their block's multiplier pair ($2), plus -0 so
#: that zero products keep their sign.
MULTIPLY_LANES_PTX = tl.constexpr("""{
.reg .b32 nz;
mov.b32 nz, 0x80008000;
fma.rn.bf16x2 $0, $1, $2, nz;
}""")


_KEEP = tl.constexpr(LANE_MASK)
_ROT1 = tl.constexpr(LANE_ROTATIONS[1])
_ROT2 = tl.constexpr(LANE_ROTATIONS[2])
_GATHER_MASK = tl.constexpr(GATHER_MASK)
_GATHER_MULTIPLIER = tl.constexpr(GATHER_MULTIPLIER)


def _field_at(field: int) -> tl.constexpr:
    """``word_bit_positions``' column ``field`` (0 sign, 1 e1, 3 m) as one constant: element
    e's bit position in bits 5e .. 5e + 4, so that a kernel reads the table with shifts."""
    return tl.constexpr(sum(bits[field] << (5 * e) for e, bits in enumerate(word_bit_positions())))


_SIGN_AT, _E1_AT, _M_AT = _field_at(0), _field_at(1), _field_at(3)


@triton.jit
def repacked_lanes(u):
    """Repacked words (uint32) -> the four bf16x2 registers ``e2m1 * 2^-126`` (see above)."""
    r0 = u & _KEEP
    # rotations (one funnel shift each on the GPU)
    r1 = ((u << _ROT1) | (u >> (32 - _ROT1))) & _KEEP
    r2 = ((u << _ROT2) | (u >> (32 - _ROT2))) & _KEEP
    r3 = ((u & _GATHER_MASK) * _GATHER_MULTIPLIER) & _KEEP
    return r0, r1, r2, r3


@triton.jit
def repacked_lanes16(u, R: tl.constexpr, KQ: tl.constexpr):
    """Repacked words uint32 [R, KQ] -> the bf16 lanes (bits, uint16) [R, 8 KQ] in K order,
    for a packed-operand PTX (``pack=2``). The two joins make dimensions the MMA operand
    layout keeps in one thread, so each pair of lanes stays the register it was computed in
    (no repacking of 16-bit values)."""
    r0, r1, r2, r3 = repacked_lanes(u)
    # join(join(a, b), join(c, d)) flattens as a, c, b, d: registers 0, 1, 2, 3
    regs = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), (R, KQ * 4))
    return tl.reshape(tl.join(regs.to(tl.uint16), (regs >> 16).to(tl.uint16)), (R, KQ * 8))


@triton.jit
def repacked_codes(u):
    """Repacked words uint32 [R, KQ] -> E2M1 codes [R, KQ, 8] in K order."""
    shift = (tl.arange(0, 8) * 5).to(tl.int64)
    sign_at = ((tl.full((8,), _SIGN_AT, tl.int64) >> shift) & 31).to(tl.uint32)
    e1_at = ((tl.full((8,), _E1_AT, tl.int64) >> shift) & 31).to(tl.uint32)
    m_at = ((tl.full((8,), _M_AT, tl.int64) >> shift) & 31).to(tl.uint32)  # e0: just above m
    w = u[:, :, None]
    return ((((w >> sign_at[None, None, :]) & 1) << 3) | (((w >> e1_at[None, None, :]) & 1) << 2)
            | ((w >> m_at[None, None, :]) & 3))


@triton.jit
def fragment_to_k(w, R: tl.constexpr, BK: tl.constexpr):
    """A tile decoded from ``"fragment"``-order words [R, BK] (position ``p`` of each 32-group:
    word ``c = p // 8``, element ``e = p % 8``) -> K order (``e2m1_words.fragment_k_order``:
    ``k = 16 (e // 4) + 8 ((e // 2) % 2) + 2 c + e % 2``). As the A
    operand of an sm_90 ``wgmma`` (``kWidth = 2``) each thread holds exactly the eight
    elements of one word per 32-group, so the compiler maps this reshape onto the registers
    the decode wrote: no shuffle, no shared memory."""
    return tl.reshape(tl.permute(tl.reshape(w, (R, BK // 32, 4, 2, 2, 2)), (0, 1, 3, 4, 2, 5)),
                      (R, BK))


@triton.jit
def fragment_tile(v0, v1, v2, v3, R: tl.constexpr, KQ: tl.constexpr):
    """The four registers of ``repacked_lanes`` [R, KQ] (uint32, two decoded bf16 lanes each,
    already scaled) of ``"fragment"``-order words -> the bf16 tile [R, 8 KQ] in K order. The
    registers are split into lanes only here, through joins the MMA operand layout keeps in
    one thread, so each pair stays the register it was computed in."""
    # join(join(a, b), join(c, d)) flattens as a, c, b, d: registers 0, 1, 2, 3
    regs = tl.reshape(tl.join(tl.join(v0, v2), tl.join(v1, v3)), (R, KQ * 4))
    halves = tl.join(regs.to(tl.uint16), (regs >> 16).to(tl.uint16))
    return fragment_to_k(tl.reshape(halves, (R, KQ * 8)).to(tl.bfloat16, bitcast=True), R,
                         KQ * 8)


@triton.jit
def weight_dot(xa, w, acc, SWAP: tl.constexpr, INTERPRET: tl.constexpr):
    """One K tile of a weight-only GEMM: ``acc + xa @ w^T`` ([M, N]) or, with ``SWAP``,
    ``acc + w @ xa^T`` ([N, M]: the decoded weight is the dot's first operand, kept in
    registers; the fragment-order kernels). The weight is cast to the activations' 16-bit
    dtype (exact for decoded FP4 values); under the interpreter both go as float32, whose dot
    is exact where its 16-bit one is not."""
    if INTERPRET:
        if SWAP:
            out = tl.dot(w.to(tl.float32), tl.trans(xa.to(tl.float32)), acc)
        else:
            out = tl.dot(xa.to(tl.float32), tl.trans(w.to(tl.float32)), acc)
    elif SWAP:
        out = tl.dot(w.to(xa.dtype), tl.trans(xa), acc)
    else:
        out = tl.dot(xa, tl.trans(w.to(xa.dtype)), acc)
    return out
