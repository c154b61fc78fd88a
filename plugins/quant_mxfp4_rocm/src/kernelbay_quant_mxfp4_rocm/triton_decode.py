# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# (Triton kernels are written in its untyped DSL.)
"""In-register decoding of packed E2M1 codes with their E8M0 block scales to exact bf16, the
inner loop of the MXFP4 GEMM. Imported lazily (this module imports triton).

Input: the packed uint8 layout ``[R, K/2]`` (element ``2i`` in the low nibble of byte ``i``:
the checkpoint layout, no repacking) read as int16 halfwords ``[R, K/4]``, each holding the
codes of four consecutive elements in its nibbles 0..3, and the E8M0 bytes ``[R, K/32]``.
Output: ``[R, K]`` in the natural K order, ``decode_e2m1 * 2^(b - 127)`` exactly as
``kernelbay.formats.dequantize_mx`` computes it in float32 (every such value has two
significant bits, so it is a bf16 whenever it is a float32; byte 255 gives NaN).

The codes of a halfword are split by three shifts and two ``tl.join``: the joined dimensions
are the ones the MMA operand layout keeps in registers, so the compiler decodes directly in
the ``tl.dot`` operand layout (no shared-memory round trip of the decoded tile; an
``arange`` of shift amounts, or a third join, loses this: see ``bench/mxfp4/inspect_kernel.py``).

Two implementations of the same function:

* ``ASM`` (CUDA, sm_80+): PTX on two elements per 32-bit register (``pack=2`` of 16-bit
  operands, each lane's code shifted to bits 12..15): an ``and``, a shift and a ``lop3``
  move each lane's ``s e1 e0 m`` to bf16's bits 15 / 8..6, which reads as ``e2m1 * 2^-126`` (code 1 the bf16 subnormal 2^-127), and
  one packed ``fma.rn.bf16x2`` by ``2^(b - 1)`` plus ``-0`` gives ``e2m1 * 2^(b - 127)``
  exactly, signed zeros included. The multiplier is a bf16 for ``b <= 128`` (``FAST``: the
  caller knows every byte of the weight is at most 128, i.e. block scales up to 2^1 and no
  NaN byte, which covers real weights; the multiplier is then made without a select);
  otherwise a second fma by ``2^max(b - 128, 0)`` follows, with the
  first factor capped at 2^127. Both products are exact (two significant bits, inside
  bf16's range including its subnormals; 6 * 2^127 overflows to inf as in float32). Each
  lane is computed from its own element's code and scale, so the result does not depend on
  how the compiler pairs elements into registers.
* plain Triton (the interpreter, ROCm): per element, the nibble as fp16 bits
  ``(c & 8) << 12 | (c & 7) << 9`` (``e2m1 * 2^-14`` exactly, code 1 an fp16 subnormal),
  widened to float32 and multiplied by ``2^(min(b, 240) - 113)`` and ``2^max(b - 240, 0)``;
  returned as float32 (the interpreter's bf16 conversion flushes subnormals).

Instruction counts of the GEMM's K loop (SASS, sm_90, per weight element per thread, from
``inspect_kernel.py``): 5.9 (FAST) for a 16x64x256 tile and 5.5 for 16x128x256, against 11-14 for
the previous decode (fp16 -> float32 -> multiply -> bf16 per element, scale gathers);
``decode_e2m1_pairs`` (the GEMM's ``pairs`` path: 32-bit words, K pairs (k, k + 4)): 4.7 for
16x64x256 and 4.5 for 16x64x512 (5.7 with ``decode_e2m1``).
"""

from __future__ import annotations

import triton
import triton.language as tl
from kernelbay.formats.e2m1_words_triton import (
    MULTIPLY_LANES_PTX,
    fragment_tile,
    fragment_to_k,
    repacked_codes,
    repacked_lanes,
    repacked_lanes16,
)

__all__ = ["PAIR_ORDER", "decode_e2m1", "decode_e2m1_fragment", "decode_e2m1_pairs",
           "decode_kernel"]

# PTX for two elements (pack=2 of 16-bit operands: each register holds two elements, the
# first in the low half): $0 the two bf16 results, $1 the two elements' codes (bits 12..15
# of each half, lower bits ignored), $2 their first multipliers (bf16 bits), $3 the second
# (GENERAL only). Each lane is computed from its own element's code and scale, so the result
# does not depend on which elements the compiler pairs.
_HEAD = """{
.reg .b32 a, b, x, nz;
mov.b32 nz, 0x80008000;
and.b32 a, $1, 0xF000F000;
shr.b32 b, a, 6;
lop3.b32 x, a, b, 0x81C081C0, 0xA8;
"""
# Each lane holds its code in bits 12..15 (s e1 e0 m, bits below: garbage, cleared by the
# and). a >> 6 moves e1 e0 m to bf16's bits 8..6; lop3 0xA8 is (a | b) & c, keeping the sign
# at bit 15 and e1 e0 m at 8..6. The lanes now read as e2m1 * 2^-126 (code 1 the subnormal
# 2^-127); fma by the multiplier plus -0 is the exact product with signed zeros.
ASM_FAST = tl.constexpr(_HEAD + "fma.rn.bf16x2 $0, x, $2, nz;\n}")
ASM_GENERAL = tl.constexpr(_HEAD + "fma.rn.bf16x2 x, x, $2, nz;\nfma.rn.bf16x2 $0, x, $3, nz;\n}")


@triton.jit
def _codes(halves, R: tl.constexpr, KH: tl.constexpr):
    """uint16 [R, 4 KH]: element k's code in bits 12..15 (lower bits: garbage), from the
    int16 halfwords [R, KH] that hold four codes each. Built by two joins, whose new
    dimensions the MMA operand layout keeps in registers; any other construction (an
    ``arange`` of shifts, a third join) makes the compiler decode in another layout and move
    the result through shared memory."""
    h = halves.to(tl.uint16, bitcast=True)
    lo = tl.join(h << 12, h << 4)  # elements 0, 2 of the halfword
    hi = tl.join(h << 8, h)  # elements 1, 3
    return tl.reshape(tl.join(lo, hi), (R, KH * 4))


@triton.jit
def _bf16_pow2(field):
    """A bf16 exponent field (int32, 1..254, or -1 for NaN) -> the bits of that power of
    two (int16)."""
    return tl.where(field < 0, 0x7FC0, field << 7).to(tl.int16)


@triton.jit
def decode_e2m1(halves, sbytes, R: tl.constexpr, KH: tl.constexpr, ASM: tl.constexpr,
                FAST: tl.constexpr):
    """``halves`` int16 [R, KH] (the packed bytes read two at a time: four codes each),
    ``sbytes`` int32 E8M0 bytes [R, KH // 8] -> [R, 4 KH] in K order (see the module
    comment): bf16 (``ASM``) or float32 holding bf16 values (plain). ``FAST`` (ASM only):
    every byte is at most 128 (so none is the NaN byte 255)."""
    BK: tl.constexpr = KH * 4
    if ASM:
        code = _codes(halves, R, KH)
        if FAST:  # every byte <= 128: no NaN byte, no clamp
            p1 = ((sbytes + 126) << 7).to(tl.int16)
        else:
            p1 = _bf16_pow2(tl.where(sbytes == 255, -1, tl.minimum(sbytes + 126, 254)))
        p1 = tl.reshape(tl.broadcast_to(p1[:, :, None], (R, KH // 8, 32)), (R, BK))
        if FAST:
            out = tl.inline_asm_elementwise(ASM_FAST, "=r,r,r", [code, p1],
                                            dtype=tl.bfloat16, is_pure=True, pack=2)
        else:
            p2 = _bf16_pow2(tl.maximum(sbytes - 128, 0) + 127)
            p2 = tl.reshape(tl.broadcast_to(p2[:, :, None], (R, KH // 8, 32)), (R, BK))
            out = tl.inline_asm_elementwise(ASM_GENERAL, "=r,r,r,r", [code, p1, p2],
                                            dtype=tl.bfloat16, is_pure=True, pack=2)
    else:
        shifts = tl.arange(0, 4) * 4
        nib = ((halves.to(tl.int32) & 0xFFFF)[:, :, None] >> shifts[None, None, :]) & 15
        nib = tl.reshape(nib, (R, BK))
        half = (((nib & 8) << 12) | ((nib & 7) << 9)).to(tl.int16).to(tl.float16, bitcast=True)
        s1 = ((tl.minimum(sbytes, 240) + 14) << 23).to(tl.float32, bitcast=True)
        s2 = ((tl.maximum(sbytes - 240, 0) + 127) << 23).to(tl.float32, bitcast=True)
        s1 = tl.where(sbytes == 255, float("nan"), s1)
        s1 = tl.reshape(tl.broadcast_to(s1[:, :, None], (R, KH // 8, 32)), (R, BK))
        s2 = tl.reshape(tl.broadcast_to(s2[:, :, None], (R, KH // 8, 32)), (R, BK))
        # float32 (exact, a bf16 value): the interpreter's bf16 conversion flushes subnormals
        out = half.to(tl.float32) * s1 * s2
    return out


#: ``decode_e2m1_pairs``' K order within each group of 8 elements: element k and k + 4
#: share one 32-bit register (one shift places both codes), so the decoded tile is in this
#: order and the GEMM permutes its activation tile to match (a reshape/permute in
#: registers; a dot product does not care about the order).
PAIR_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


# The repacked layout's lanes already read as e2m1 * 2^-126: the single-multiply decode is the
# core's MULTIPLY_LANES_PTX, the general one multiplies twice.
ASM_GENERAL_REPACKED = tl.constexpr("""{
.reg .b32 nz, x;
mov.b32 nz, 0x80008000;
fma.rn.bf16x2 x, $1, $2, nz;
fma.rn.bf16x2 $0, x, $3, nz;
}""")


@triton.jit
def decode_e2m1_pairs(words, sbytes, R: tl.constexpr, KQ: tl.constexpr, ASM: tl.constexpr,
                      FAST: tl.constexpr, REPACKED: tl.constexpr = False):
    """``words`` int32 [R, KQ] (eight codes each), ``sbytes`` int32 E8M0 bytes [R, KQ // 4]
    -> [R, 8 KQ], values as ``decode_e2m1``'s (bf16 with ``ASM``, float32 holding bf16 values
    otherwise).

    ``REPACKED``: the words of ``kernelbay.formats.repack_e2m1_words``, in the natural K
    order: ``repacked_lanes16`` gives the bf16 lanes with one mask, or a rotation and a mask,
    per two elements for elements 0..5 of a word (a mask, a multiply and a mask for 6..7), and
    the PTX is the scale multiply alone.

    Otherwise the packed bytes read four at a time, the tile in ``PAIR_ORDER`` within each
    word: one 32-bit shift per word and j (0..3) puts element j's code in bits 12..15 and
    element j + 4's in bits 28..31, the two halves are the lanes of ``decode_e2m1``'s PTX and
    the compiler keeps each pair in one register (K loop of a 16x64x512 tile on sm_90: 4.5
    SASS instructions per weight element, against 5.7 for ``decode_e2m1``)."""
    BK: tl.constexpr = KQ * 8
    u = words.to(tl.uint32, bitcast=True)
    if not REPACKED:
        # [R, KQ, 4] over j = 0..3 (two joins: dimensions the MMA layout keeps in registers)
        code = tl.reshape(tl.join(tl.join(u << 12, u << 4), tl.join(u << 8, u)), (R, KQ * 4))
    if ASM:
        if REPACKED:
            c16 = repacked_lanes16(u, R, KQ)
        else:
            c16 = tl.reshape(tl.join(code.to(tl.uint16), (code >> 16).to(tl.uint16)), (R, BK))
        if FAST:  # every byte <= 128: no NaN byte, no clamp
            p1 = ((sbytes + 126) << 7).to(tl.int16)
        else:
            p1 = _bf16_pow2(tl.where(sbytes == 255, -1, tl.minimum(sbytes + 126, 254)))
        p1 = tl.reshape(tl.broadcast_to(p1[:, :, None], (R, KQ // 4, 32)), (R, BK))
        if FAST:
            if REPACKED:
                res = tl.inline_asm_elementwise(MULTIPLY_LANES_PTX, "=r,r,r", [c16, p1],
                                                dtype=tl.bfloat16, is_pure=True, pack=2)
            else:
                res = tl.inline_asm_elementwise(ASM_FAST, "=r,r,r", [c16, p1],
                                                dtype=tl.bfloat16, is_pure=True, pack=2)
        else:
            p2 = _bf16_pow2(tl.maximum(sbytes - 128, 0) + 127)
            p2 = tl.reshape(tl.broadcast_to(p2[:, :, None], (R, KQ // 4, 32)), (R, BK))
            if REPACKED:
                res = tl.inline_asm_elementwise(ASM_GENERAL_REPACKED, "=r,r,r,r", [c16, p1, p2],
                                                dtype=tl.bfloat16, is_pure=True, pack=2)
            else:
                res = tl.inline_asm_elementwise(ASM_GENERAL, "=r,r,r,r", [c16, p1, p2],
                                                dtype=tl.bfloat16, is_pure=True, pack=2)
    else:
        if REPACKED:
            nib = tl.reshape(repacked_codes(u), (R, BK))
        else:
            c = code.to(tl.int32, bitcast=True)
            nib = tl.reshape(tl.join((c >> 12) & 15, (c >> 28) & 15), (R, BK))
        half = (((nib & 8) << 12) | ((nib & 7) << 9)).to(tl.int16).to(tl.float16,
                                                                       bitcast=True)
        s1 = ((tl.minimum(sbytes, 240) + 14) << 23).to(tl.float32, bitcast=True)
        s2 = ((tl.maximum(sbytes - 240, 0) + 127) << 23).to(tl.float32, bitcast=True)
        s1 = tl.where(sbytes == 255, float("nan"), s1)
        s1 = tl.reshape(tl.broadcast_to(s1[:, :, None], (R, KQ // 4, 32)), (R, BK))
        s2 = tl.reshape(tl.broadcast_to(s2[:, :, None], (R, KQ // 4, 32)), (R, BK))
        res = half.to(tl.float32) * s1 * s2
    return res


@triton.jit
def _scaled_register(r, p1, p2, FAST: tl.constexpr):
    """One repacked register (two lanes, uint32) times its block's multiplier pair(s)."""
    if FAST:
        out = tl.inline_asm_elementwise(MULTIPLY_LANES_PTX, "=r,r,r", [r, p1],
                                        dtype=tl.uint32, is_pure=True, pack=1)
    else:
        out = tl.inline_asm_elementwise(ASM_GENERAL_REPACKED, "=r,r,r,r", [r, p1, p2],
                                        dtype=tl.uint32, is_pure=True, pack=1)
    return out


@triton.jit
def decode_e2m1_fragment(words, sbytes, R: tl.constexpr, KQ: tl.constexpr, ASM: tl.constexpr,
                         FAST: tl.constexpr):
    """``"fragment"``-order repacked words int32 [R, KQ] (``kernelbay.formats.
    repack_e2m1_words(order="fragment")``) and E8M0 bytes int32 [R, KQ // 4] -> [R, 8 KQ] in
    K order, values as ``decode_e2m1``'s.

    A 32-element group of four words is one MX block, so every register of a word takes the
    same multiplier pair, made once per block as a 32-bit value (both bf16 halves:
    ``(b + 126) << 7`` times 0x10001: one byte extraction and one multiply-add for ``FAST``)
    and broadcast to the block's words: no per-element scale packing."""
    u = words.to(tl.uint32, bitcast=True)
    if ASM:
        b = sbytes.to(tl.uint32)
        if FAST:  # every byte <= 128: no NaN byte to select
            p1 = b * 0x800080 + 0x3F003F00
            p2 = p1
        else:
            p1 = tl.where(b == 255, 0x7FC07FC0, tl.minimum(b + 126, 254) * 0x10001 << 7)
            p2 = (tl.maximum(b, 128) - 1) * 0x800080
        p1 = tl.reshape(tl.broadcast_to(p1[:, :, None], (R, KQ // 4, 4)), (R, KQ))
        p2 = tl.reshape(tl.broadcast_to(p2[:, :, None], (R, KQ // 4, 4)), (R, KQ))
        r0, r1, r2, r3 = repacked_lanes(u)
        out = fragment_tile(_scaled_register(r0, p1, p2, FAST),
                            _scaled_register(r1, p1, p2, FAST),
                            _scaled_register(r2, p1, p2, FAST),
                            _scaled_register(r3, p1, p2, FAST), R, KQ)
    else:  # the block's scale is the same at every position of the group
        out = fragment_to_k(decode_e2m1_pairs(words, sbytes, R, KQ, False, FAST, True), R,
                            KQ * 8)
    return out


@triton.jit
def decode_kernel(w_ptr, s_ptr, out_ptr, N, KH, stride_w, stride_s, stride_o,
                  BLOCK_R: tl.constexpr, BLOCK_KH: tl.constexpr, ASM: tl.constexpr,
                  FAST: tl.constexpr, OUT_BITS: tl.constexpr, REPACKED: tl.constexpr = False,
                  FRAGMENT: tl.constexpr = False):
    """Dequantize a packed weight (int16 halfwords [N, KH], bytes [N, KH / 8]) to bf16
    [N, 4 KH] with ``decode_e2m1`` (the GEMM's dequantize-then-matmul path, and the
    decoder's tests); ``REPACKED``: the weight is repacked words [N, KH / 2] decoded by
    ``decode_e2m1_pairs``, with ``FRAGMENT`` in the ``"fragment"`` K order (relabelled by
    ``fragment_to_k``: one MX block per 32-group, so the scales apply before).
    ``OUT_BITS``: store int16 bits (the interpreter cannot store bf16 exactly)."""
    rr = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rk = tl.program_id(1) * BLOCK_KH + tl.arange(0, BLOCK_KH)
    rs = tl.program_id(1) * (BLOCK_KH // 8) + tl.arange(0, BLOCK_KH // 8)
    ok = rr[:, None] < N
    r64 = rr.to(tl.int64)
    sb = tl.load(s_ptr + r64[:, None] * stride_s + rs[None, :],
                 mask=ok & (rs[None, :] < KH // 8), other=127).to(tl.int32)
    if REPACKED:
        rq = tl.program_id(1) * (BLOCK_KH // 2) + tl.arange(0, BLOCK_KH // 2)
        words = tl.load(w_ptr + r64[:, None] * stride_w + rq[None, :],
                        mask=ok & (rq[None, :] < KH // 2), other=0)
        w = decode_e2m1_pairs(words, sb, BLOCK_R, BLOCK_KH // 2, ASM, FAST, True)
        if FRAGMENT:
            w = fragment_to_k(w, BLOCK_R, BLOCK_KH * 4)
    else:
        halves = tl.load(w_ptr + r64[:, None] * stride_w + rk[None, :],
                         mask=ok & (rk[None, :] < KH), other=0)
        w = decode_e2m1(halves, sb, BLOCK_R, BLOCK_KH, ASM, FAST)
    ro = tl.program_id(1) * (BLOCK_KH * 4) + tl.arange(0, BLOCK_KH * 4)
    o_ptr = out_ptr + r64[:, None] * stride_o + ro[None, :]
    o_mask = ok & (ro[None, :] < KH * 4)
    if OUT_BITS:
        # exact values: float32 bits >> 16 are the bf16 bits (no rounding happens)
        tl.store(o_ptr, (w.to(tl.float32).to(tl.int32, bitcast=True) >> 16).to(tl.int16),
                 mask=o_mask)
    else:
        tl.store(o_ptr, w, mask=o_mask)
