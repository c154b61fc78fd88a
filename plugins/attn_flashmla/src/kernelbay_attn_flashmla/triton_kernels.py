# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# (Triton kernels are written in its untyped DSL.)
"""Triton kernels for MLA over paged records: split-KV decode, its combine, and cache writes.

Imported only when the ``mla-triton`` backend runs (imports triton). One program of the
decode kernel serves one query token, one KV split and a block of up to ``BLOCK_H`` heads:
every KV tile it reads is used by all those heads in one ``[BLOCK_H, D] x [D, BLOCK_N]``
``tl.dot``, so with 16 query heads each page is read once per request. Records are read
straight from the uint8 pages and dequantized in registers:

    KIND 0  bf16       nope bf16, rope bf16
    KIND 1  fp8        nope E4M3 * fp32 scale of its group, rope bf16
    KIND 2  fp8-e8m0   nope E4M3 * 2^(byte - 127) of its group, rope bf16
    KIND 3  mxfp8      nope and rope E4M3 * 2^(byte - 127) of their block

Field offsets, group sizes and the record size come from the descriptor as constexprs.
The cache write kernel quantizes bit for bit as ``codec.encode_records`` (the shared
``kernelbay.formats`` rules), with integer rounding so the interpreter and the GPU agree.
"""

from __future__ import annotations

import triton
import triton.language as tl
from kernelbay.triton_pdl import grid_release, grid_wait

__all__ = ["mla_combine_kernel", "mla_decode_kernel", "mla_write_kernel"]

LOG2E = 1.4426950408889634


# Reductions go through tl.reduce with these combiners, and no other triton.language.standard
# helper is used: those are jitted when triton is imported, so under the interpreter they
# only work if TRITON_INTERPRET was set before that import; these follow this module.
@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _at(cache_u8, offset, dtype: tl.constexpr):
    """Pointers to ``dtype`` values at byte ``offset`` of the pages. Record fields are
    addressed in bytes and the pointer cast, not ``offset // size`` in elements: a signed
    64-bit division costs a sign fix-up per address, and the compiler no longer knows the
    records' alignment (so loads would not vectorize)."""
    return (cache_u8 + offset).to(tl.pointer_type(dtype))


@triton.jit
def _pow2(e):
    """2^e (float32) for an int32 e in [-127, 127], exactly (2^-127 is subnormal)."""
    bits = tl.where(e >= -126, (e + 127) << 23, 0x00400000)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_to_f32(code, FAST_FP8: tl.constexpr):
    """Decode E4M3 bytes (uint8) to float32; the hardware cast on the GPU, integer math
    under the interpreter (numpy has no float8)."""
    if FAST_FP8:
        return code.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    c = code.to(tl.int32)
    e = (c >> 3) & 15
    m = (c & 7).to(tl.float32)
    mag = tl.where(e == 0, m * 0.001953125, (m + 8.0) * _pow2(e - 10))
    return tl.where((c & 128) != 0, -mag, mag)


@triton.jit
def _load_part(cache_u8, row, rows_ok, cols, cols_ok,
               ELEM_OFF: tl.constexpr, COL0: tl.constexpr, SCALE_OFF: tl.constexpr,
               GROUP: tl.constexpr, SCALE: tl.constexpr, BLOCK_N: tl.constexpr,
               C_PAD: tl.constexpr, COUNT: tl.constexpr, FAST_FP8: tl.constexpr):
    """Values ``[BLOCK_N, C_PAD]`` of columns ``cols`` of a record field (bfloat16 or
    float32; the caller casts them to the dot type).

    ``row`` [BLOCK_N] byte offsets of the records; the field's ``COUNT`` elements start at
    byte ``ELEM_OFF``. SCALE 0: bf16 elements; 1: E4M3 with fp32 group scales at
    ``SCALE_OFF``; 2: E4M3 with E8M0 group scales; ``COL0`` is the first column's index in
    the scaled values (the rope of an MXFP8 record follows its nope in the same blocks).
    """
    mask = rows_ok[:, None] & cols_ok[None, :]
    if SCALE == 0:
        values = tl.load(_at(cache_u8, row[:, None] + ELEM_OFF, tl.bfloat16) + cols[None, :],
                         mask=mask, other=0.0)
    else:
        code = tl.load(cache_u8 + (row[:, None] + ELEM_OFF + cols[None, :]), mask=mask,
                       other=0)
        if FAST_FP8 and SCALE == 2:
            # E4M3 values and power-of-two scales are exact in bfloat16 and so is their
            # product: dequantizing in bfloat16 rounds as float32 would, in half the
            # registers.
            values = code.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
        else:
            values = _e4m3_to_f32(code, FAST_FP8)
        if (COL0 % GROUP == 0) and (C_PAD % GROUP == 0):
            # Groups line up with the tile: one scale load per group, broadcast over it.
            NG: tl.constexpr = C_PAD // GROUP
            local = tl.arange(0, NG)
            g_mask = rows_ok[:, None] & (local * GROUP < COUNT)[None, :]
            scale = _group_scale(cache_u8, row, COL0 // GROUP + local, g_mask,
                                 SCALE_OFF, SCALE, FAST_FP8)
            values = tl.reshape(tl.reshape(values, [BLOCK_N, NG, GROUP]) * scale[:, :, None],
                                [BLOCK_N, C_PAD])
        else:
            scale = _group_scale(cache_u8, row, (COL0 + cols) // GROUP, mask,
                                 SCALE_OFF, SCALE, FAST_FP8)
            values = values * scale
    return values


@triton.jit
def _group_scale(cache_u8, row, group, mask, SCALE_OFF: tl.constexpr,
                 SCALE: tl.constexpr, FAST_FP8: tl.constexpr):
    """Scales of groups ``group`` (broadcast against ``row[:, None]``): fp32 (SCALE 1), or
    E8M0 bytes (SCALE 2) as bfloat16 on the GPU and float32 under the interpreter."""
    return _group_scale3(cache_u8, row[:, None], group[None, :], mask, SCALE_OFF,
                         SCALE, FAST_FP8)


@triton.jit
def _load_nope3(cache_u8, row3, ok3, col3, ELEM_OFF: tl.constexpr,
                SCALE_OFF: tl.constexpr, GROUP: tl.constexpr, SCALE: tl.constexpr,
                NC: tl.constexpr, BLOCK_N: tl.constexpr, CH: tl.constexpr,
                RANK: tl.constexpr, FAST_FP8: tl.constexpr):
    """The nope values ``[NC, BLOCK_N, CH]`` of a KV tile, chunk ``c`` holding columns
    ``c * CH ...`` (``row3`` [1, BLOCK_N, 1] record offsets, ``col3`` [NC, 1, CH] columns);
    bfloat16 or float32, the caller casts them to the dot type."""
    mask = ok3 & (col3 < RANK)
    if SCALE == 0:
        values = tl.load(_at(cache_u8, row3 + ELEM_OFF, tl.bfloat16) + col3, mask=mask,
                         other=0.0)
    else:
        code = tl.load(cache_u8 + (row3 + ELEM_OFF + col3), mask=mask, other=0)
        if FAST_FP8 and SCALE == 2:
            # E4M3 values and power-of-two scales are exact in bfloat16 and so is their
            # product: dequantizing in bfloat16 rounds as float32 would, in half the
            # registers.
            values = code.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
        else:
            values = _e4m3_to_f32(code, FAST_FP8)
        chunk = tl.arange(0, NC)[:, None, None]
        if GROUP % CH == 0:
            # A chunk lies inside one group: one scale per record and chunk.
            first = chunk * CH
            scale = _group_scale3(cache_u8, row3, first // GROUP,
                                  ok3 & (first < RANK), SCALE_OFF, SCALE, FAST_FP8)
            values = values * scale
        else:
            # CH // GROUP groups per chunk: one scale per group, broadcast over it.
            NG: tl.constexpr = CH // GROUP
            local = tl.arange(0, NG)[None, None, :]
            first = chunk * CH + local * GROUP
            scale = _group_scale3(cache_u8, row3, first // GROUP,
                                  ok3 & (first < RANK), SCALE_OFF, SCALE, FAST_FP8)
            values = tl.reshape(tl.reshape(values, [NC, BLOCK_N, NG, GROUP])
                                * scale[:, :, :, None], [NC, BLOCK_N, CH])
    return values


@triton.jit
def _group_scale3(cache_u8, row3, group, mask, SCALE_OFF: tl.constexpr,
                  SCALE: tl.constexpr, FAST_FP8: tl.constexpr):
    """Scales of groups ``group`` of records ``row3`` (offsets that broadcast against
    ``group``): fp32 (SCALE 1), or E8M0 bytes (SCALE 2) as bfloat16 on the GPU and float32
    under the interpreter."""
    if SCALE == 1:
        scale = tl.load(_at(cache_u8, row3 + SCALE_OFF, tl.float32) + group, mask=mask,
                        other=0.0)
    else:
        byte = tl.load(cache_u8 + (row3 + SCALE_OFF + group), mask=mask, other=127)
        if FAST_FP8:
            # The byte is bfloat16's exponent field; byte 0 (2^-127) is the subnormal with
            # mantissa bit 6.
            bits = tl.where(byte == 0, 0x0040, byte.to(tl.int32) << 7).to(tl.int16)
            scale = bits.to(tl.bfloat16, bitcast=True)
        else:
            scale = _pow2(byte.to(tl.int32) - 127)
    return scale


@triton.jit
def _load_groups3(cache_u8, row, ok, col3, ELEM_OFF: tl.constexpr,
                  SCALE_OFF: tl.constexpr, GROUP: tl.constexpr, SCALE: tl.constexpr,
                  NC: tl.constexpr, RANK: tl.constexpr, FAST_FP8: tl.constexpr):
    """The nope codes ``[NC, BLOCK_N, GROUP]`` of a KV tile decoded but not scaled (chunk
    ``c`` is scale group ``c``), and the group scales ``[NC, 1, BLOCK_N]`` (float32, 0 for
    padding groups and keys not allowed)."""
    mask = ok[None, :, None] & (col3 < RANK)
    code = tl.load(cache_u8 + (row[None, :, None] + ELEM_OFF + col3), mask=mask, other=0)
    if FAST_FP8:
        # E4M3 -> bfloat16 is exact (and one conversion instruction per pair on sm_90).
        values = code.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
    else:
        values = _e4m3_to_f32(code, FAST_FP8)
    group = tl.arange(0, NC)[:, None, None]
    g_mask = ok[None, None, :] & (group * GROUP < RANK)
    row3 = row[None, None, :]
    if SCALE == 1:
        scale = tl.load(_at(cache_u8, row3 + SCALE_OFF, tl.float32) + group, mask=g_mask,
                        other=0.0)
    else:
        byte = tl.load(cache_u8 + (row3 + SCALE_OFF + group), mask=g_mask, other=0)
        scale = tl.where(g_mask, _pow2(byte.to(tl.int32) - 127), 0.0)
    return values, scale


@triton.jit
def _tile(n0, hi, start, length, seq, t, topk_ptr, topk_stride, block_tables, bt_stride,
          BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, PAGE_BYTES: tl.constexpr,
          BPT: tl.constexpr, SPARSE: tl.constexpr):
    """Byte offsets ``[BLOCK_N]`` of the records of keys ``n0 ...`` and which are allowed.
    Sparse: ``n0`` indexes the token's top-k list (``hi`` its end). Dense: ``n0`` is the
    first key's position, a multiple of ``BLOCK_N`` (``_key_range``), keys ``start <= pos <
    hi`` allowed; when ``BLOCK_N`` divides the page size the tile lies in one page, whose
    block-table entry is read once and whose records follow each other, so the offsets are
    one base plus multiples of ``BPT`` (the loads then share one address computation)."""
    offs = n0 + tl.arange(0, BLOCK_N)
    ok = offs < hi
    if SPARSE:
        pos = tl.load(topk_ptr + t * topk_stride + offs, mask=ok, other=-1)
        ok = ok & (pos >= start) & (pos < length)
    else:
        ok = ok & (offs >= start)
        pos = offs
    if (not SPARSE) and PAGE_SIZE % BLOCK_N == 0:
        # A tile past the sequence (the L2 prefetch runs ahead) reads page 0: a valid address.
        page = tl.load(block_tables + seq * bt_stride + n0 // PAGE_SIZE, mask=n0 < length,
                       other=0)
        row = (page.to(tl.int64) * PAGE_BYTES + (n0 % PAGE_SIZE) * BPT
               + tl.arange(0, BLOCK_N) * BPT)
    else:
        pos = tl.where(ok, pos, 0)
        page = tl.load(block_tables + seq * bt_stride + pos // PAGE_SIZE, mask=ok, other=0)
        row = page.to(tl.int64) * PAGE_BYTES + (pos % PAGE_SIZE).to(tl.int64) * BPT
    return row, ok


@triton.jit
def _key_range(split, num_splits, start, length, num_topk, BLOCK_N: tl.constexpr,
               SPARSE: tl.constexpr):
    """The tiles of KV split ``split``: ``(lo, hi)`` for ``range(lo, hi, BLOCK_N)`` and
    ``_tile``. Sparse: positions in the top-k list. Dense: key positions from ``start``
    rounded down to a tile (the keys before ``start`` are masked), so that every tile starts
    at a multiple of ``BLOCK_N`` and lies in one page."""
    if SPARSE:
        base = 0
        limit = num_topk
    else:
        base = (start // BLOCK_N) * BLOCK_N
        limit = length
    per_split = (((limit - base + num_splits - 1) // num_splits + BLOCK_N - 1) // BLOCK_N
                 * BLOCK_N)
    lo = base + split * per_split
    return lo, tl.minimum(lo + per_split, limit)


@triton.jit
def _prefetch_l2(cache_u8, row, BPT: tl.constexpr, LINES: tl.constexpr):
    """Ask L2 for every 128-byte line of the records at ``row`` (``prefetch.global.L2``, no
    registers held, nothing waited for): the tile's later loads then find it in L2.
    ``LINES`` (a power of two) covers a record at any offset; extra lines repeat the last."""
    off = tl.minimum(tl.arange(0, LINES) * 128, BPT - 1)
    ptrs = cache_u8 + (row[:, None] + off[None, :])
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _fetch_codes(cache_u8, row, ok, cols, cols_ok, ELEM_OFF: tl.constexpr,
                 SCALE_OFF: tl.constexpr, GROUP: tl.constexpr, SCALE: tl.constexpr,
                 C_PAD: tl.constexpr, COUNT: tl.constexpr):
    """The raw E4M3 codes ``[BLOCK_N, C_PAD]`` of a nope field and their raw scales (one per
    group ``[BLOCK_N, C_PAD // GROUP]``, fp32 or E8M0 bytes), for ``_dequant_codes``."""
    mask = ok[:, None] & cols_ok[None, :]
    code = tl.load(cache_u8 + (row[:, None] + ELEM_OFF + cols[None, :]), mask=mask, other=0)
    NG: tl.constexpr = C_PAD // GROUP
    local = tl.arange(0, NG)
    g_mask = ok[:, None] & (local * GROUP < COUNT)[None, :]
    if SCALE == 1:
        raw = tl.load(_at(cache_u8, row[:, None] + SCALE_OFF, tl.float32) + local[None, :],
                      mask=g_mask, other=0.0)
    else:
        raw = tl.load(cache_u8 + (row[:, None] + SCALE_OFF + local[None, :]), mask=g_mask,
                      other=127)
    return code, raw


#: Four E4M3 codes times their block's power of two, as two bf16x2 registers
#: (``tl.inline_asm_elementwise`` with pack 4: $0 elements 0-1, $1 elements 2-3; $2 the four
#: code bytes, packed as loaded; $3-$6 and $7-$10 the four elements' multiplier pairs ``low``
#: and ``high``, of which elements 0 and 2 are read: a pair of elements never straddles a
#: 32-aligned block). Each byte goes to the low byte of a 16-bit lane with its sign replicated
#: over the high byte (PRMT's sign mode); shifted left by 4, the magnitude's exponent and
#: mantissa bits land on bfloat16's and the mask keeps them and one sign bit: the lane is ``e4m3
#: * 2^-120`` exactly (an E4M3 subnormal on a bfloat16 subnormal, zero on zero). Two packed
#: multiplies by powers of two finish it: five instructions per pair where the conversion
#: through float16 takes about eight. The codes 0x7F and 0xFF (NaN in E4M3; the cache writer
#: never stores them) come out finite.
E8M0_SCALED_PTX = tl.constexpr("""{
.reg .b32 t0, t1;
prmt.b32 t0, $2, 0, 0x9180;
prmt.b32 t1, $2, 0, 0xB3A2;
shl.b32 t0, t0, 4;
shl.b32 t1, t1, 4;
and.b32 t0, t0, 0x87F087F0;
and.b32 t1, t1, 0x87F087F0;
mul.rn.bf16x2 t0, t0, $3;
mul.rn.bf16x2 t1, t1, $5;
mul.rn.bf16x2 $0, t0, $7;
mul.rn.bf16x2 $1, t1, $9;
}""")


@triton.jit
def _fetch_words(cache_u8, row, ok, ELEM_OFF: tl.constexpr,
                 SCALE_OFF: tl.constexpr, GROUP: tl.constexpr, C_PAD: tl.constexpr,
                 COUNT: tl.constexpr):
    """A tile's E4M3 codes as words ``[BLOCK_N, C_PAD // GROUP, GROUP // 4]`` (four codes
    each, little-endian; ``row`` and ``ELEM_OFF`` multiples of 4) and its E8M0 bytes
    ``[BLOCK_N, C_PAD // GROUP]``, for ``_e8m0_words``. Words keep four codes in one
    register, where a uint8 tile takes a register per code (what a prefetched tile costs
    while it waits for the next iteration)."""
    NG: tl.constexpr = C_PAD // GROUP
    group = tl.arange(0, NG)[None, :, None]
    word = group * (GROUP // 4) + tl.arange(0, GROUP // 4)[None, None, :]
    words = tl.load(_at(cache_u8, row[:, None, None] + ELEM_OFF, tl.int32) + word,
                    mask=ok[:, None, None] & (word < COUNT // 4), other=0)
    local = tl.arange(0, NG)
    raw = tl.load(cache_u8 + (row[:, None] + SCALE_OFF + local[None, :]),
                  mask=ok[:, None] & (local * GROUP < COUNT)[None, :], other=127)
    return words, raw


@triton.jit
def _e8m0_words(words, raw, BLOCK_N: tl.constexpr, C_PAD: tl.constexpr,
                GROUP: tl.constexpr, FAST_FP8: tl.constexpr):
    """The values ``[BLOCK_N, C_PAD]`` of ``_fetch_words``' codes: each E4M3 code times
    ``2^(raw - 127)`` of its block, exactly; bfloat16 by ``E8M0_SCALED_PTX`` on the GPU,
    float32 by integer math under the interpreter."""
    # The words' bytes in K order (join(join(a, c), join(b, d)) flattens as a, b, c, d):
    # the packed operand below gets each word back as it was loaded, no byte moved.
    b0 = (words & 255).to(tl.uint8)
    b1 = ((words >> 8) & 255).to(tl.uint8)
    b2 = ((words >> 16) & 255).to(tl.uint8)
    b3 = ((words >> 24) & 255).to(tl.uint8)
    shape: tl.constexpr = [BLOCK_N, C_PAD // GROUP, GROUP]
    code = tl.reshape(tl.join(tl.join(b0, b2), tl.join(b1, b3)), shape)
    e = raw.to(tl.int32)
    if FAST_FP8:
        # The lanes are e4m3 * 2^-120: a factor 2^(raw - 7) finishes them while it is a
        # bfloat16 normal (raw <= 134, block maxima up to 448 * 2^7); a second one, 1
        # below that, covers the rest of E8M0's range. Both products are exact.
        low = (((tl.minimum(e, 134) + 120) << 7) * 0x10001)[:, :, None]
        high = (((tl.maximum(e, 134) - 7) << 7) * 0x10001)[:, :, None]
        values = tl.inline_asm_elementwise(
            E8M0_SCALED_PTX, "=r,=r,r,r,r,r,r,r,r,r,r",
            [code, tl.broadcast_to(low, shape), tl.broadcast_to(high, shape)],
            dtype=tl.bfloat16, is_pure=True, pack=4)
    else:
        values = _e4m3_to_f32(code, False) * _pow2(e - 127)[:, :, None]
    return tl.reshape(values, [BLOCK_N, C_PAD])


@triton.jit
def _dequant_codes(code, raw, GROUP: tl.constexpr, SCALE: tl.constexpr,
                   BLOCK_N: tl.constexpr, C_PAD: tl.constexpr, FAST_FP8: tl.constexpr,
                   F16: tl.constexpr):
    """Values of codes fetched by ``_fetch_codes``: float32 codes times fp32 group scales
    (SCALE 1), or with ``F16`` float16 codes times either scale kind (E4M3 -> float16 is
    one packed conversion per pair and float16 products are packed multiplies). E8M0
    scales without ``F16`` go through ``_fetch_words`` / ``_e8m0_words`` instead."""
    if F16:
        values = code.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        # fp32 scales round to float16 (2^-11, below the bfloat16 product's 2^-9); E8M0
        # scales are exact in its range.
        scale = (raw if SCALE == 1 else _pow2(raw.to(tl.int32) - 127)).to(tl.float16)
    else:
        values = _e4m3_to_f32(code, FAST_FP8)
        scale = raw
    NG: tl.constexpr = C_PAD // GROUP
    return tl.reshape(tl.reshape(values, [BLOCK_N, NG, GROUP]) * scale[:, :, None],
                      [BLOCK_N, C_PAD])


# Sizes and strides that vary between calls are not specialized on: one compile per record
# kind and launch shape, whatever the batch, split count or table width.
@triton.jit(do_not_specialize=["q_stride_t", "q_stride_h", "bt_stride", "topk_stride",
                               "num_topk", "out_stride_t", "out_stride_s", "out_stride_h",
                               "lse_stride_t", "lse_stride_s", "num_heads", "num_splits"])
def mla_decode_kernel(
    q_ptr, q_stride_t, q_stride_h,
    cache_u8,
    block_tables, bt_stride,
    tok_seq, tok_len, tok_start,
    topk_ptr, topk_stride, num_topk,
    out_ptr, out_stride_t, out_stride_s, out_stride_h,
    lse_ptr, lse_stride_t, lse_stride_s,
    num_heads, sm_scale, num_splits,
    RANK: tl.constexpr, ROPE: tl.constexpr,
    NC: tl.constexpr, CH: tl.constexpr, R_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, PAGE_BYTES: tl.constexpr,
    BPT: tl.constexpr, NOPE_OFF: tl.constexpr, ROPE_OFF: tl.constexpr, SCALE_OFF: tl.constexpr,
    GROUP: tl.constexpr, NOPE_SCALE: tl.constexpr, ROPE_SCALE: tl.constexpr,
    SPARSE: tl.constexpr, FAST_FP8: tl.constexpr, DOT: tl.constexpr, CHUNKED: tl.constexpr,
    GROUPED: tl.constexpr, REG_PREFETCH: tl.constexpr, L2_AHEAD: tl.constexpr,
    L2_LINES: tl.constexpr, F16_DOT: tl.constexpr, PDL: tl.constexpr = False,
):
    """Partial attention of query token ``t`` over KV split ``split`` for heads
    ``hb * BLOCK_H ...``, program ``(t * num_splits + split) * head_blocks + hb``: writes the normalised partial output
    (float32, or the final output when num_splits == 1) and its natural-log LSE. ``DOT`` is
    the dot operand type: bfloat16 on the GPU, float32 under the interpreter (whose numpy
    dot has no bfloat16), or float16 on request (``f16_dot``: quantized nope decoded and
    scaled in float16; exact while the dequantized values, queries and probabilities lie
    in float16's range, |x| < 65504 and above 2^-14 for full precision). ``CHUNKED`` holds the nope part as ``NC`` chunks of ``CH`` columns
    (batched dots, one chunk per warp) instead of one ``[BLOCK_H, NC * CH]`` block.
    ``L2_AHEAD`` > 0 (GPU only): each iteration asks L2 for the records of the tile that
    many tiles ahead, so far more bytes are in flight than registers or shared memory hold.
    ``GROUPED`` (chunked, quantized nope, ``CH == GROUP``): the codes go to the dots
    unscaled; each group's scale multiplies its partial scores ``[BLOCK_H, BLOCK_N]`` and
    the probabilities of its value product, so no element of the tile is scaled. ``PDL``
    (``kernelbay.triton_pdl``): waits for the kernels before it ahead of its first load, and
    lets the next programmatic launch (the combine) start once its key loop is done."""
    # One flat grid, head blocks fastest: the programs that read the same KV split (one per
    # head block) run side by side, so all but the first find its tiles in L2.
    pid = tl.program_id(0)
    head_blocks = (num_heads + BLOCK_H - 1) // BLOCK_H
    hb = pid % head_blocks
    split = (pid // head_blocks) % num_splits
    t = pid // (head_blocks * num_splits)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    heads_ok = heads < num_heads
    rcols = tl.arange(0, R_PAD)
    if PDL:
        grid_wait()
    rcols_ok = rcols < ROPE

    q_row = q_ptr + t * q_stride_t + heads[:, None] * q_stride_h
    # Quantized nope in the flat layout: the next tile's codes and scales are loaded before
    # this tile is computed on (the compiler's pipelining does not reach loads that feed
    # dots through the dequantization), so one tile is always in flight.
    PREFETCH: tl.constexpr = (REG_PREFETCH and (not CHUNKED) and NOPE_SCALE != 0
                              and (NC * CH) % GROUP == 0)
    # E8M0-scaled codes: fetched as words (decoded by E8M0_SCALED_PTX on the GPU).
    WORDS: tl.constexpr = PREFETCH and NOPE_SCALE == 2 and not F16_DOT
    if CHUNKED:
        # The nope part in NC chunks of CH columns, [NC, BLOCK_H, CH]: batched dots give
        # each warp its own chunk, so no warp holds the whole [BLOCK_H, D] query or tile.
        col3 = tl.arange(0, NC)[:, None, None] * CH + tl.arange(0, CH)[None, None, :]
        h3 = heads[None, :, None]
        q3 = tl.load(q_ptr + t * q_stride_t + h3 * q_stride_h + col3,
                     mask=(h3 < num_heads) & (col3 < RANK), other=0.0).to(DOT)
        acc3 = tl.full([NC, BLOCK_H, CH], 0.0, tl.float32)
    else:
        dcols = tl.arange(0, NC * CH)
        dcols_ok = dcols < RANK
        q_nope = tl.load(q_row + dcols[None, :], mask=heads_ok[:, None] & dcols_ok[None, :],
                         other=0.0).to(DOT)
        acc2 = tl.full([BLOCK_H, NC * CH], 0.0, tl.float32)
    q_rope = tl.load(q_row + RANK + rcols[None, :], mask=heads_ok[:, None] & rcols_ok[None, :],
                     other=0.0).to(DOT)

    seq = tl.load(tok_seq + t)
    length = tl.load(tok_len + t)      # keys at positions < length are causal
    start = tl.load(tok_start + t)     # and >= start (sliding window)
    lo, hi = _key_range(split, num_splits, start, length, num_topk, BLOCK_N, SPARSE)

    qk_scale = sm_scale * 1.4426950408889634
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_H], 0.0, tl.float32)
    if PREFETCH:
        row_n, ok_n = _tile(lo, hi, start, length, seq, t, topk_ptr, topk_stride,
                            block_tables, bt_stride, BLOCK_N, PAGE_SIZE, PAGE_BYTES, BPT,
                            SPARSE)
        if WORDS:
            code_n, raw_n = _fetch_words(cache_u8, row_n, ok_n, NOPE_OFF,
                                         SCALE_OFF, GROUP, NC * CH, RANK)
        else:
            code_n, raw_n = _fetch_codes(cache_u8, row_n, ok_n, dcols, dcols_ok,
                                         NOPE_OFF, SCALE_OFF, GROUP, NOPE_SCALE, NC * CH,
                                         RANK)
    if L2_AHEAD > 0:
        # The first L2_AHEAD tiles; each iteration then asks for the tile L2_AHEAD ahead.
        for k in tl.static_range(L2_AHEAD):
            _prefetch_l2(cache_u8, _tile(lo + k * BLOCK_N, hi, start, length, seq, t, topk_ptr,
                                         topk_stride, block_tables, bt_stride, BLOCK_N,
                                         PAGE_SIZE, PAGE_BYTES, BPT, SPARSE)[0],
                         BPT, L2_LINES)
    for n0 in range(lo, hi, BLOCK_N):
        if L2_AHEAD > 0:
            # Tiles past hi read valid addresses (_tile: position 0 or page 0).
            _prefetch_l2(cache_u8, _tile(n0 + L2_AHEAD * BLOCK_N, hi, start, length, seq, t,
                                         topk_ptr, topk_stride, block_tables, bt_stride,
                                         BLOCK_N, PAGE_SIZE, PAGE_BYTES, BPT, SPARSE)[0],
                         BPT, L2_LINES)
        if PREFETCH:
            row = row_n
            ok = ok_n
            code = code_n
            raw = raw_n
            row_n, ok_n = _tile(n0 + BLOCK_N, hi, start, length, seq, t, topk_ptr,
                                topk_stride, block_tables, bt_stride, BLOCK_N, PAGE_SIZE,
                                PAGE_BYTES, BPT, SPARSE)
            if WORDS:
                code_n, raw_n = _fetch_words(cache_u8, row_n, ok_n, NOPE_OFF,
                                             SCALE_OFF, GROUP, NC * CH, RANK)
            else:
                code_n, raw_n = _fetch_codes(cache_u8, row_n, ok_n, dcols,
                                             dcols_ok, NOPE_OFF, SCALE_OFF, GROUP, NOPE_SCALE,
                                             NC * CH, RANK)
        else:
            row, ok = _tile(n0, hi, start, length, seq, t, topk_ptr, topk_stride,
                            block_tables, bt_stride, BLOCK_N, PAGE_SIZE, PAGE_BYTES, BPT,
                            SPARSE)
        if GROUPED:
            k3, sc3 = _load_groups3(cache_u8, row, ok, col3, NOPE_OFF, SCALE_OFF,
                                    GROUP, NOPE_SCALE, NC, RANK, FAST_FP8)
            k3 = k3.to(DOT)
            s_nope = tl.reduce(tl.dot(q3, tl.permute(k3, (0, 2, 1))) * sc3, 0, _add)
        elif CHUNKED:
            k3 = _load_nope3(cache_u8, row[None, :, None],
                             ok[None, :, None], col3, NOPE_OFF, SCALE_OFF, GROUP, NOPE_SCALE,
                             NC, BLOCK_N, CH, RANK, FAST_FP8).to(DOT)
            s_nope = tl.reduce(tl.dot(q3, tl.permute(k3, (0, 2, 1))), 0, _add)
        else:
            if WORDS:
                k_nope = _e8m0_words(code, raw, BLOCK_N, NC * CH, GROUP, FAST_FP8).to(DOT)
            elif PREFETCH:
                k_nope = _dequant_codes(code, raw, GROUP, NOPE_SCALE, BLOCK_N, NC * CH,
                                        FAST_FP8, F16_DOT).to(DOT)
            else:
                k_nope = _load_part(cache_u8, row, ok, dcols,
                                    dcols_ok, NOPE_OFF, 0, SCALE_OFF, GROUP, NOPE_SCALE,
                                    BLOCK_N, NC * CH, RANK, FAST_FP8).to(DOT)
            s_nope = tl.dot(q_nope, tl.trans(k_nope))
        k_rope = _load_part(cache_u8, row, ok, rcols, rcols_ok,
                            ROPE_OFF, RANK, SCALE_OFF, GROUP, ROPE_SCALE, BLOCK_N, R_PAD, ROPE,
                            FAST_FP8).to(DOT)
        s = s_nope + tl.dot(q_rope, tl.trans(k_rope))
        s = tl.where(ok[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _max))
        # A tile with no allowed key keeps m = -inf; subtract 0 then so exp2 gives 0.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.reduce(p, 1, _add)
        if GROUPED:
            # Group c's values are codes * scale[c, key]: the scale goes into P's columns.
            p3 = (p[None, :, :] * sc3).to(DOT)
            acc3 = acc3 * alpha[None, :, None] + tl.dot(p3, k3)
        elif CHUNKED:
            p3 = tl.broadcast_to(p.to(DOT)[None, :, :], [NC, BLOCK_H, BLOCK_N])
            acc3 = acc3 * alpha[None, :, None] + tl.dot(p3, k3)
        else:
            acc2 = acc2 * alpha[:, None] + tl.dot(p.to(DOT), k_nope)
        m_i = m_new

    if PDL:
        grid_release()
    has = l_i > 0.0
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) / 1.4426950408889634,
                   float("-inf"))
    o_base = out_ptr + t * out_stride_t + split * out_stride_s
    if CHUNKED:
        out3 = acc3 / tl.where(has, l_i, 1.0)[None, :, None]
        tl.store(o_base + h3 * out_stride_h + col3, out3.to(out_ptr.dtype.element_ty),
                 mask=(h3 < num_heads) & (col3 < RANK))
    else:
        out2 = acc2 / tl.where(has, l_i, 1.0)[:, None]
        tl.store(o_base + heads[:, None] * out_stride_h + dcols[None, :],
                 out2.to(out_ptr.dtype.element_ty), mask=heads_ok[:, None] & dcols_ok[None, :])
    tl.store(lse_ptr + t * lse_stride_t + split * lse_stride_s + heads, lse, mask=heads_ok)


@triton.jit(do_not_specialize=["part_stride_t", "part_stride_s", "part_stride_h",
                               "plse_stride_t", "plse_stride_s", "out_stride_t",
                               "out_stride_h", "lse_stride_t", "num_heads", "num_splits"])
def mla_combine_kernel(
    part_ptr, part_stride_t, part_stride_s, part_stride_h,
    plse_ptr, plse_stride_t, plse_stride_s,
    out_ptr, out_stride_t, out_stride_h,
    lse_ptr, lse_stride_t,
    num_heads, num_splits,
    S_PAD: tl.constexpr, S_BLOCK: tl.constexpr, RANK: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Merge the split partials of token ``program_id(0)``, head ``program_id(1)``, columns
    ``[BLOCK_D * program_id(2), + BLOCK_D)``: lse = logsumexp_i lse_i, out = sum_i
    exp(lse_i - lse) * out_i (no key: 0 and -inf; the first column block writes the lse).

    ``S_BLOCK`` 1: one split's row per step, which waits on L2 once per split (its add needs
    the load before the next step's load issues): fine when there are enough programs to
    cover it. Otherwise the partials come in blocks of ``S_BLOCK`` splits x ``BLOCK_D``
    columns, one load each (``triton_mla.combine_blocks`` chooses). ``PDL``: waits for the decode kernel before its first
    load (as its programmatic dependent it was launched while that kernel ran)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.program_id(2)
    if PDL:
        grid_wait()
    splits = tl.arange(0, S_PAD)
    s_ok = splits < num_splits
    lse_row = plse_ptr + t * plse_stride_t + h
    lses = tl.load(lse_row + splits * plse_stride_s, mask=s_ok, other=float("-inf"))
    m = tl.reduce(lses, 0, _max)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.reduce(tl.exp(lses - m_safe), 0, _add)
    inv_total = 1.0 / tl.where(total > 0.0, total, 1.0)
    cols = d * BLOCK_D + tl.arange(0, BLOCK_D)
    cols_ok = cols < RANK
    part_row = part_ptr + t * part_stride_t + h * part_stride_h
    out = tl.full([BLOCK_D], 0.0, tl.float32)
    if S_BLOCK == 1:
        # one split's row per step (many programs keep enough loads in flight)
        for i in range(0, num_splits):
            w_i = tl.exp(tl.load(lse_row + i * plse_stride_s) - m_safe) * inv_total
            out += w_i * tl.load(part_row + i * part_stride_s + cols, mask=cols_ok, other=0.0)
    else:
        rows = tl.arange(0, S_BLOCK)
        for s0 in range(0, num_splits, S_BLOCK):
            s = s0 + rows
            ok = s < num_splits
            # a split without keys (or past the count) weighs 0 and its partial is 0
            w = tl.exp(tl.load(lse_row + s * plse_stride_s, mask=ok, other=float("-inf"))
                       - m_safe) * inv_total
            block = tl.load(part_row + s[:, None] * part_stride_s + cols[None, :],
                            mask=ok[:, None] & cols_ok[None, :], other=0.0)
            out += tl.reduce(w[:, None] * block, 0, _add)
    tl.store(out_ptr + t * out_stride_t + h * out_stride_h + cols, out.to(
        out_ptr.dtype.element_ty), mask=cols_ok)
    if d == 0:
        lse = tl.where(total > 0.0, m_safe + tl.log(tl.where(total > 0.0, total, 1.0)),
                       float("-inf"))
        tl.store(lse_ptr + t * lse_stride_t + h, lse)
    if PDL:
        grid_release()


@triton.jit
def _bf16_bits(x):
    """bfloat16 bits (int16) of float32 ``x``, rounded to nearest even (NaN not produced)."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    return (rounded >> 16).to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def _e4m3_bits(y):
    """E4M3 byte of float32 ``y``: clamp to +-448, round to nearest even (as torch's cast)."""
    a = tl.minimum(tl.abs(y), 448.0)
    bits = a.to(tl.uint32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20).to(tl.int32) - (120 << 3)
    # Below 2^-6 the codes are multiples of 2^-9: round a * 512 to an integer (exact scaling,
    # then the 2^23 trick rounds to nearest even).
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(a < 0.015625, sub, normal)
    sign = ((y.to(tl.uint32, bitcast=True) >> 31) << 7).to(tl.int32)
    return (code | sign).to(tl.uint8)


@triton.jit
def _mx_exponent(amax):
    """OCP MX "rceil" block exponent for E4M3: ceil(log2(amax / 448)) clamped to [-127, 127],
    from amax's bits (amax below the smallest normal counts as that normal; inf gives 127)."""
    bits = amax.to(tl.uint32, bitcast=True)
    e = ((bits >> 23) & 0xFF).to(tl.int32)
    m = (bits & 0x7FFFFF).to(tl.int32)
    # amax / 448 = (1.m / 1.75) * 2^(e - 135): above 2^(e - 135) exactly when 1.m > 1.75.
    x = tl.where(e == 0, 1, e) - 135 + tl.where((e != 0) & (m > 0x600000), 1, 0)
    x = tl.where(e == 255, 127, x)
    return tl.minimum(tl.maximum(x, -127), 127)


@triton.jit
def _quantize_groups(cache_u8, cache_f32, lat_ptr, row, COL0: tl.constexpr,
                     COUNT: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr,
                     ELEM_OFF: tl.constexpr, SCALE_OFF: tl.constexpr, E8M0: tl.constexpr,
                     DIV_RN: tl.constexpr):
    """Quantize latent columns ``COL0 .. COL0 + COUNT`` in groups of ``GROUP`` to E4M3 codes
    at ``ELEM_OFF`` and one scale per group at ``SCALE_OFF`` (fp32 amax / 448, or E8M0)."""
    g = tl.arange(0, G_PAD)
    c = tl.arange(0, GROUP)
    g_ok = g < COUNT // GROUP
    cols = g[:, None] * GROUP + c[None, :]
    mask = g_ok[:, None] & (c[None, :] < GROUP)
    x = tl.load(lat_ptr + COL0 + cols, mask=mask, other=0.0).to(tl.float32)
    amax = tl.reduce(tl.abs(x), 1, _max)
    if E8M0:
        e = _mx_exponent(amax)
        y = x * _pow2(-e)[:, None]
        tl.store(cache_u8 + row + SCALE_OFF + g, (e + 127).to(tl.uint8), mask=g_ok)
    else:
        # Correctly rounded divisions as torch's: div_rn on the GPU (``/`` may be approximate
        # there); the interpreter's numpy ``/`` already is, and has no div_rn.
        if DIV_RN:
            scale = tl.where(amax == 0.0, 1.0, tl.math.div_rn(
                amax, tl.full(amax.shape, 448.0, tl.float32)))
            y = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
        else:
            scale = tl.where(amax == 0.0, 1.0, amax / 448.0)
            y = x / scale[:, None]
        tl.store(cache_f32 + (row + SCALE_OFF) // 4 + g, scale, mask=g_ok)
    tl.store(cache_u8 + row + ELEM_OFF + cols, _e4m3_bits(y), mask=mask)


@triton.jit
def _store_bf16(cache_i16, lat_ptr, row, COL0: tl.constexpr, COUNT: tl.constexpr,
                C_PAD: tl.constexpr, ELEM_OFF: tl.constexpr):
    """Store latent columns ``COL0 .. COL0 + COUNT`` as bfloat16 at byte ``ELEM_OFF``."""
    c = tl.arange(0, C_PAD)
    ok = c < COUNT
    x = tl.load(lat_ptr + COL0 + c, mask=ok, other=0.0).to(tl.float32)
    tl.store(cache_i16 + (row + ELEM_OFF) // 2 + c, _bf16_bits(x), mask=ok)


@triton.jit(do_not_specialize=["lat_stride"])
def mla_write_kernel(
    lat_ptr, lat_stride, slots,
    cache_u8, cache_i16, cache_f32,
    RANK: tl.constexpr, ROPE: tl.constexpr, D_PAD: tl.constexpr, R_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr, PAGE_BYTES: tl.constexpr, BPT: tl.constexpr, KIND: tl.constexpr,
    NOPE_OFF: tl.constexpr, ROPE_OFF: tl.constexpr, SCALE_OFF: tl.constexpr,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, DIV_RN: tl.constexpr,
):
    """Encode latent ``program_id(0)`` into the record of its slot (negative slot: skip)."""
    t = tl.program_id(0)
    slot = tl.load(slots + t).to(tl.int64)
    if slot >= 0:
        row = (slot // PAGE_SIZE) * PAGE_BYTES + (slot % PAGE_SIZE) * BPT
        lat = lat_ptr + t.to(tl.int64) * lat_stride
        if KIND == 0:
            _store_bf16(cache_i16, lat, row, 0, RANK, D_PAD, NOPE_OFF)
            _store_bf16(cache_i16, lat, row, RANK, ROPE, R_PAD, ROPE_OFF)
        elif KIND == 3:
            _quantize_groups(cache_u8, cache_f32, lat, row, 0, RANK + ROPE, GROUP, G_PAD,
                             NOPE_OFF, SCALE_OFF, True, DIV_RN)
        else:
            _quantize_groups(cache_u8, cache_f32, lat, row, 0, RANK, GROUP, G_PAD, NOPE_OFF,
                             SCALE_OFF, KIND == 2, DIV_RN)
            _store_bf16(cache_i16, lat, row, RANK, ROPE, R_PAD, ROPE_OFF)
