// MLA decode attention over E4M3 records, sm_80+ (sm_90 for records that are not a multiple
// of 16 bytes). KIND picks the record:
//   KIND_MX    MXFP8: DIM E4M3 values (latent, then rope), one E8M0 byte per 32 at SCALE_OFF;
//   KIND_E8M0  E4M3 latent (RANK values) with one E8M0 byte per 64 at SCALE_OFF, and 64
//              bfloat16 rope values at ROPE_OFF (the 584-byte record);
//   KIND_FP32  E4M3 latent (RANK values) with one float32 multiplier per 128 at SCALE_OFF, and
//              64 bfloat16 rope values at ROPE_OFF (the 656-byte record).
// The E4M3 values of every kind go through the same decode and MMAs; the rope of the last two
// adds one MMA step per warp to the scores (16 rope values each, read as bfloat16 pairs), and a
// float32 multiplier, not a power of two, is applied to the scores and the probabilities
// (steps 2 and 4 below) instead of the decoded values, which then stay exact.
//
// Compiled at run time by NVRTC (kernelbay.cuda_jit; cuda_mla.build_options) with KIND, DIM
// (value slots per record: four warps of 128), RANK (latent width), BPT (bytes per record),
// SCALE_OFF (the scales' offset), ROPE_OFF (the bfloat16 rope's offset), TILE, STAGES,
// MIN_BLOCKS, QSMEM, SPLIT_SUM, BULK, LAZY_MAX and SPARSE defined by the host.
//
// One CTA serves one query token, one KV split and a block of 16 query heads, with four
// warps; warp w owns the E4M3 values [128w, 128w + 128) (latent, and for KIND_MX rope in the
// last columns; slots past the record's E4M3 values are zero) and, with a bfloat16 rope, rope
// values [16w, 16w + 16). Keys come in tiles of TILE (16 or 32) (a tile lies in one page),
// copied from the pages into shared memory STAGES tiles ahead by one bulk (TMA) copy each of
// the whole tile (keys outside the attended range are zeroed in registers as they are
// decoded: a slot never written must not bring NaN into the products, where 0 * NaN is NaN),
// which completes on the stage's mbarrier (BULK, sm_90: one instruction per tile instead of a
// 16-byte cp.async per thread and chunk, whose requests loaded the L1 pipeline this kernel is
// bound by), or STAGES - 1 tiles ahead by cp.async. With SPARSE (BULK only) a tile is TILE
// entries of the token's top-k list, each key copied by a bulk copy of its own into a slot
// of KEY_BYTES (see issue).
// Per tile, warp w:
//   1. decodes its 128 values of each key into bfloat16 registers, already in the layout of
//      mma.sync m16n8k16's B operand (k = value, n = key): lane (g, c) = (lane / 4, lane % 4)
//      takes key key_of(g) of each 8-key group (a permutation that spreads the loads over
//      the banks) and the eight values 32j + 8c .. + 7 of each chunk j, a register holding
//      value i of chunks 2p and 2p + 1 side by side (one factor pair scales both), i.e. the
//      value order inside each 16-value MMA step is permuted; the query is loaded with the
//      same permutation, and a dot product does not care about the order;
//   2. multiplies its query slice with them: partial scores [16 heads, TILE keys];
//   3. adds the four warps' partial scores through shared memory (warp order, so the result
//      does not depend on scheduling; SPLIT_SUM: each warp sums a quarter, then all read the
//      totals) and scales them to log2 units once; every warp then runs the same online
//      softmax (LAZY_MAX: each warp exponentiates the quarter it summed against the running
//      max and shares the probabilities, already as the value product's A fragments; only a
//      tile with a score more than LAZY_SLACK above that max -- the first tile, a new
//      maximum -- takes the full softmax, decided by one barrier's vote; each warp keeps the
//      running sum of its quarter, and the four are added in warp order at the end);
//   4. transposes each 8 x 8 block of its decoded keys in registers (movmatrix), which turns
//      the B operand of the score product (k = value, n = key) into the B operand of the value
//      product (k = key, n = value): the keys are decoded once for both products and never
//      go back through shared memory;
//   5. accumulates probabilities x values for its latent columns in float32.
// Lane (g, c) ends up owning the eight contiguous output columns 128w + 32j + 8c .. + 7 of
// heads g and g + 8, written as one vector each: the normalised partial output (float32)
// and its natural-log LSE when the context is split, else the bfloat16 output.
//
// Decoding a pair of codes (value i of chunks 2p and 2p + 1): a byte permute of the two
// chunks' words puts each code in its own 16-bit lane with its
// sign replicated over the byte above; a shift by 4 and a mask leave the bfloat16 of
// e4m3 * 2^-120 (subnormals and zeros included, exactly; the NaN codes 0x7f/0xff, which the
// writer never stores outside NaN blocks, come out as +-480); one bf16x2 multiply by the exact
// power of two 2^(e - 7) applies the block's scale 2^(e - 127) (scale bytes above 134, where
// 2^(e - 7) is past bfloat16's range, get a second multiply under one vote per tile).

#include "kernelbay/ptx.cuh"  // u32, copies, mbarriers, shared loads and stores

#define KIND_MX 0
#define KIND_E8M0 1
#define KIND_FP32 2
#ifndef KIND
#define KIND KIND_MX
#endif
// The last two kinds keep the rope in bfloat16, apart from the E4M3 values.
#define ROPE_BF16 (KIND != KIND_MX)
#ifndef ROPE_OFF
#define ROPE_OFF 0
#endif

#ifndef DIM
#define DIM 512
#endif
#ifndef RANK
#define RANK 448
#endif
#ifndef BPT
#define BPT 528
#endif
#ifndef SCALE_OFF
#define SCALE_OFF 512
#endif
#ifndef STAGES
#define STAGES 4
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 2
#endif
#ifndef SPLIT_SUM
#define SPLIT_SUM 0  // 1: the partial scores summed in two phases (see the tile loop)
#endif
#ifndef QSMEM
#define QSMEM 0  // 1: the query slice waits in shared memory (32 registers fewer per thread)
#endif
#ifndef LAZY_MAX
#define LAZY_MAX 0  // 1: probabilities against the running max, in the score sum (see below)
#endif
#if LAZY_MAX && !SPLIT_SUM
#error "LAZY_MAX needs SPLIT_SUM (each warp exponentiates the score totals it sums)"
#endif
// LAZY_MAX: a tile whose scores stay within LAZY_SLACK (log2 units) of the running max keeps
// that max, so its probabilities are at most 2^LAZY_SLACK (exact in the bfloat16 products and
// far from float32's range).
#define LAZY_SLACK 8.f


#ifndef BULK
#define BULK 0  // 1: each tile copied by one bulk (TMA) copy completing on an mbarrier
#endif
#if BULK && defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#undef BULK
#define BULK 0  // bulk copies need sm_90: the per-thread copies on older GPUs
#endif
#if BULK && !SPLIT_SUM
#error "BULK needs SPLIT_SUM (its first in-tile barrier frees the tile's slot for the next copy)"
#endif
#ifndef SPARSE
#define SPARSE 0  // 1: the keys each query's top-k list names, one bulk copy per key
#endif
#if SPARSE && !BULK
#error "SPARSE needs BULK (sm_90): each key of a tile is a bulk copy of its own"
#endif

#ifndef TILE
#define TILE 16  // keys per tile: 16 or 32 (one round of the tile loop's barriers each)
#endif
#if TILE != 16 && TILE != 32
#error "TILE must be 16 or 32"
#endif
#define WARPS 4
#define G8 (TILE / 8)  // 8-key groups of a tile (the score product's n tiles)
#define CHUNKS 4  // 32-value chunks per warp (128 values)
#if DIM != WARPS * CHUNKS * 32
#error "DIM must be 512: four warps of 128 values"
#endif
#if RANK % 32 || RANK > DIM
#error "RANK must be a multiple of 32 and at most DIM"
#endif
#if BPT % 16 && !BULK
#error "BPT must be a multiple of 16 for the 16-byte copies (whole tiles by BULK need not)"
#endif
#if BPT % 8
#error "BPT must be a multiple of 8 (64-bit shared loads of each record)"
#endif
// E4M3 values per record; the warps' slots past them are zero
#define CODES (ROPE_BF16 ? RANK : DIM)
#if KIND == KIND_E8M0 && RANK % 64
#error "KIND_E8M0 scales groups of 64: RANK must be a multiple of 64"
#endif
#if KIND == KIND_FP32 && RANK % 128
#error "KIND_FP32 scales groups of 128 (one per warp): RANK must be a multiple of 128"
#endif
#if KIND != KIND_MX && KIND != KIND_E8M0 && KIND != KIND_FP32
#error "KIND must be KIND_MX, KIND_E8M0 or KIND_FP32"
#endif
#if ROPE_BF16 && (ROPE_OFF % 8 || SCALE_OFF % 4)
#error "the rope must be 8-byte and the scales 4-byte aligned in the record"
#endif
#if SPARSE
// A key's slot: its record by one bulk copy of whole 16-byte units from the 16-byte aligned
// address at or below it (a 584-byte record at an odd position starts 8 bytes past one: its
// slot then holds it from byte 8, which the stage's second mask word records). Pages hold an
// even number of records, so the copy of an even position's record never reads past its page.
#define KEY_BYTES ((BPT + 15) / 16 * 16)
#else
#define KEY_BYTES BPT
#endif
#define SHIFTED (KEY_BYTES != BPT)
#define MASK_WORDS (SHIFTED ? 2 : 1)  // (SPARSE) per stage: the keys read, and which are shifted
#define TILE_BYTES (TILE * KEY_BYTES)
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f
#define NEG_INF __int_as_float(0xff800000)

// The key (0..7 of its 8-key group) in column g of the score product's B fragment. A lane
// decodes 8 bytes at one offset of its key's record, and a 64-bit shared load is served per
// half-warp (lanes 4g + c, g = 0..3 or 4..7): with 528-byte records, keys g and g + 1 lie 16
// bytes apart modulo 128 and their lanes' pieces overlap (two-way bank conflicts); keys 2g'
// and 2g' + 2 lie 32 bytes apart, so the four keys of a half-warp fill 128 bytes. A dot
// product does not care which column holds which key; only positions (masks) need it.
// (Measured on the H200: 0.5-1.5% faster with 32-key tiles, no change with 16-key ones.)
__device__ __forceinline__ int key_of(int g) { return ((g & 3) << 1) | (g >> 2); }

__device__ __forceinline__ u32 bf16x2_mul(u32 a, u32 b) {
  u32 out;
  // fma with -0.0 addend: an exact product (a +0.0 addend would turn -0.0 into +0.0)
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(out) : "r"(a), "r"(b), "r"(0x80008000u));
  return out;
}

// The first factors of a word of four scale bytes: byte j becomes byte + 120, the bfloat16
// exponent field of 2^(byte - 7), which ``pair_factor`` places in a lane. Valid for bytes up
// to 134 (no carry between bytes); ``large_scales`` finds the others.
__device__ __forceinline__ u32 factor_bytes(u32 scales) { return scales + 0x78787878u; }

// Nonzero when a byte of ``scales`` is 135 or more: its top bit set and its low seven bits
// at least 7 (no carry between bytes: (b & 0x7f) + 0x79 <= 0xf8).
__device__ __forceinline__ u32 large_scales(u32 scales) {
  return ((scales & 0x7F7F7F7Fu) + 0x79797979u) & scales & 0x80808080u;
}

// The first factors of chunks 2P and 2P + 1 side by side: bytes 2P and 2P + 1 of ``bytes``
// (``factor_bytes``) as the bfloat16 exponent fields of the low and the high lane.
template <int P>
__device__ __forceinline__ u32 pair_factor(u32 bytes) {
  u32 r;  // byte 2P into byte 0, byte 2P + 1 into byte 2, zeros (byte 4 of the zero operand)
  asm("prmt.b32 %0, %1, 0, %2;" : "=r"(r) : "r"(bytes), "n"(0x4040 | ((2 * P + 1) << 8) | 2 * P));
  return r << 7;
}

// Code i (< 4) of words a and b as the bfloat16 lanes (a_i, b_i) of e4m3 * 2^-120: one byte
// permute (each code with its sign replicated over the byte above), a shift and a mask.
template <int I>
__device__ __forceinline__ u32 e4m3_cross(u32 a, u32 b) {
  u32 r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r)
      : "r"(a), "r"(b), "n"(I | ((8 | I) << 4) | ((4 + I) << 8) | ((12 + I) << 12)));
  return (r << 4) & 0x87F087F0u;
}

// The eight codes of two chunks of one key (a: chunk 2P, b: chunk 2P + 1) times the factor
// pair ``f`` (chunk 2P's in the low lane): code i of each chunk, (a_i, b_i), in lo[i] for
// i < 4 (the codes of a.x, b.x) and hi[i - 4] above (a.y, b.y).
__device__ __forceinline__ void decode_pair(uint2 a, uint2 b, u32 f, u32 (&lo)[4],
                                            u32 (&hi)[4]) {
  lo[0] = e4m3_cross<0>(a.x, b.x);
  lo[1] = e4m3_cross<1>(a.x, b.x);
  lo[2] = e4m3_cross<2>(a.x, b.x);
  lo[3] = e4m3_cross<3>(a.x, b.x);
  hi[0] = e4m3_cross<0>(a.y, b.y);
  hi[1] = e4m3_cross<1>(a.y, b.y);
  hi[2] = e4m3_cross<2>(a.y, b.y);
  hi[3] = e4m3_cross<3>(a.y, b.y);
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    lo[r] = bf16x2_mul(lo[r], f);
    hi[r] = bf16x2_mul(hi[r], f);
  }
}

// The bfloat16 bits of 2^x for x in [-126, 127].
__device__ __forceinline__ u32 pow2_bits(int x) { return (u32)(x + 127) << 7; }

// The same times 2^(scale - 127) for any scale bytes sa, sb (two factors for bytes above
// 134, where 2^(scale - 7) is past bfloat16's range; byte 255 is E8M0's NaN).
__device__ __forceinline__ void decode_pair_any(uint2 a, uint2 b, u32 sa, u32 sb,
                                                u32 (&lo)[4], u32 (&hi)[4]) {
  const int ea = (int)sa - 7, eb = (int)sb - 7;
  decode_pair(a, b, pow2_bits(ea < 127 ? ea : 127) | (pow2_bits(eb < 127 ? eb : 127) << 16),
              lo, hi);
  if (sa > 134u || sb > 134u) {
    const u32 fa = sa == 255u ? 0x7FC0u : sa > 134u ? pow2_bits(ea - 127) : 0x3F80u;
    const u32 fb = sb == 255u ? 0x7FC0u : sb > 134u ? pow2_bits(eb - 127) : 0x3F80u;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      lo[r] = bf16x2_mul(lo[r], fa | (fb << 16));
      hi[r] = bf16x2_mul(hi[r], fa | (fb << 16));
    }
  }
}

// KIND_FP32 decodes with this constant factor pair (2^120 in both lanes): the E4M3 value
// exactly; its float32 multiplier comes after the products.
#define EXACT_FACTORS 0x7B807B80u

// The scale bytes of a key (record at ``rec``) for warp ``warp``'s chunks, as ``pair_factor``
// reads them: chunk 2p's in byte 2p, chunk 2p + 1's in byte 2p + 1 (KIND_E8M0: pair p's one
// byte in both). Zero where the warp has no E4M3 values and for KIND_FP32 (no factor bytes).
__device__ __forceinline__ u32 scale_bytes(u32 rec, int warp) {
#if KIND == KIND_MX
  return lds32(rec + SCALE_OFF + warp * 4);
#elif KIND == KIND_E8M0
  if (warp * 128 >= CODES) return 0u;
  return __byte_perm(lds32(rec + SCALE_OFF + 4 * (warp >> 1)), 0u, (warp & 1) ? 0x3322u : 0x1100u);
#else
  return 0u;
#endif
}

// Whether warp ``warp``'s chunk pair ``p`` holds E4M3 values (a uniform branch per warp).
__device__ __forceinline__ bool pair_has_codes(int warp, int p) {
  return CODES == DIM || warp * 128 + 64 * p < CODES;
}

__device__ __forceinline__ void mma(float* d, const u32* a, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 transpose8x8(u32 x) {
  u32 y;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}

// 2^x with results below 2^-126 flushed to zero (exp2f adds a range fix-up of three
// instructions per call for them; a probability that small adds nothing to a float32 sum).
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// The query slice: in shared memory (QSMEM: the lane's slot of MMA step 0; steps 512 B
// apart) or in registers (qa[step]).
#if QSMEM
#define QUERY_ARGS q_slots
typedef u32 QuerySlice;
__device__ __forceinline__ void query_step(QuerySlice q_slots, int step, u32* a) {
  const uint4 q = lds128(q_slots + step * 512);
  a[0] = q.x; a[1] = q.y; a[2] = q.z; a[3] = q.w;
}
#else
#define QUERY_ARGS qa
typedef const u32 (*QuerySlice)[4];
__device__ __forceinline__ void query_step(QuerySlice qa, int step, u32* a) {
#pragma unroll
  for (int i = 0; i < 4; ++i) a[i] = qa[step][i];
}
#endif

// The score products of chunk j (MMA steps 2j, 2j + 1) added into d[n].
__device__ __forceinline__ void chunk_scores(int j, float (*d)[4], const u32 (&kb)[G8][CHUNKS][4],
                                             QuerySlice query) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    u32 a[4];
    query_step(query, 2 * j + h, a);
#pragma unroll
    for (int n = 0; n < G8; ++n) mma(d[n], a, kb[n][j][2 * h], kb[n][j][2 * h + 1]);
  }
}

// 4-5. values, 16 keys per MMA: A = P[16 heads, keys 16k..] (key order = score column
// order; pa[2i + h]: keys of 8-key group 2k + i, head g + 8h), B = each 8 x 8 block of keys x
// values of the warp's latent chunks, transposed. ALL_LATENT: every chunk of the warp is
// latent, known at compile time (no branch per chunk, each of which cost a warp
// reconvergence before its movmatrix).
template <bool ALL_LATENT>
__device__ __forceinline__ void value_step(float (&acc)[CHUNKS][4][4], const u32 (&pa)[4],
                                           const u32 (&kb)[G8][CHUNKS][4], int k, int warp) {
#pragma unroll
  for (int j = 0; j < CHUNKS; ++j) {
    if (ALL_LATENT || warp * 128 + (j / 2) * 64 < RANK) {  // the pair's first chunk
#pragma unroll
      for (int b = 0; b < 4; ++b)
        mma(acc[j][b], pa, transpose8x8(kb[2 * k][j][b]), transpose8x8(kb[2 * k + 1][j][b]));
    }
  }
}

// Whether every chunk of the warp is latent (the warps past them skip their rope chunks).
__device__ __forceinline__ bool all_latent(int warp) { return (warp + 1) * 128 <= RANK; }

// ks[n][i]: the multiplier of the key in column 2c + i of 8-key group n for this warp's values
// (KIND_FP32; 1 for the other kinds, whose multiplies the compiler drops).
typedef float KeyScales[G8][2];

template <bool ALL_LATENT>
__device__ __forceinline__ void value_products_as(float (&acc)[CHUNKS][4][4],
                                                  const float (&p)[G8][4],
                                                  const u32 (&kb)[G8][CHUNKS][4], int warp,
                                                  const KeyScales& ks) {
#pragma unroll
  for (int k = 0; k < G8 / 2; ++k) {
    const float(&s0)[2] = ks[2 * k];
    const float(&s1)[2] = ks[2 * k + 1];
    const u32 pa[4] = {pack_bf16(p[2 * k][0] * s0[0], p[2 * k][1] * s0[1]),
                       pack_bf16(p[2 * k][2] * s0[0], p[2 * k][3] * s0[1]),
                       pack_bf16(p[2 * k + 1][0] * s1[0], p[2 * k + 1][1] * s1[1]),
                       pack_bf16(p[2 * k + 1][2] * s1[0], p[2 * k + 1][3] * s1[1])};
    value_step<ALL_LATENT>(acc, pa, kb, k, warp);
  }
}

__device__ __forceinline__ void value_products(float (&acc)[CHUNKS][4][4], const float (&p)[G8][4],
                                               const u32 (&kb)[G8][CHUNKS][4], int warp,
                                               const KeyScales& ks) {
  if (all_latent(warp)) value_products_as<true>(acc, p, kb, warp, ks);
  else value_products_as<false>(acc, p, kb, warp, ks);
}

// The same with the A fragments the warps shared (LAZY_MAX): step k's four registers side by
// side per lane at p_slots + (k * 32 + lane) * 16.
// (KIND_FP32: each shared probability, a bfloat16, times its key's multiplier for this warp
// and rounded again.)
template <bool ALL_LATENT>
__device__ __forceinline__ void value_products_shared_as(float (&acc)[CHUNKS][4][4], u32 p_slots,
                                                         const u32 (&kb)[G8][CHUNKS][4], int warp,
                                                         int lane, const KeyScales& ks) {
#pragma unroll
  for (int k = 0; k < G8 / 2; ++k) {
    const uint4 v = lds128(p_slots + (k * 32 + lane) * 16);
    u32 pa[4] = {v.x, v.y, v.z, v.w};
#if KIND == KIND_FP32
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const float(&s)[2] = ks[2 * k + r / 2];  // registers 0, 1: group 2k; 2, 3: group 2k + 1
      pa[r] = pack_bf16(__uint_as_float(pa[r] << 16) * s[0],
                        __uint_as_float(pa[r] & 0xFFFF0000u) * s[1]);
    }
#endif
    value_step<ALL_LATENT>(acc, pa, kb, k, warp);
  }
}

__device__ __forceinline__ void value_products_shared(float (&acc)[CHUNKS][4][4], u32 p_slots,
                                                      const u32 (&kb)[G8][CHUNKS][4], int warp,
                                                      int lane, const KeyScales& ks) {
  if (all_latent(warp)) value_products_shared_as<true>(acc, p_slots, kb, warp, lane, ks);
  else value_products_shared_as<false>(acc, p_slots, kb, warp, lane, ks);
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS)
mla_decode_mx(const unsigned short* __restrict__ query, long long q_stride_t, long long q_stride_h,
              const unsigned char* __restrict__ cache, long long page_bytes, int page_shift,
              const int* __restrict__ block_tables, long long bt_stride,
              const int* __restrict__ tok_seq, const int* __restrict__ tok_len,
              const int* __restrict__ tok_start,
              const int* __restrict__ topk, long long topk_stride, int num_topk,
              float* __restrict__ part, long long part_stride_t, long long part_stride_s,
              long long part_stride_h,
              float* __restrict__ plse, long long plse_stride_t, long long plse_stride_s,
              unsigned short* __restrict__ out, long long out_stride_t, long long out_stride_h,
              int num_heads, float scale, int num_splits) {
  extern __shared__ __align__(16) unsigned char smem[];
  const u32 tiles_base = (u32)__cvta_generic_to_shared(smem);
  // partial scores [WARPS][G8][32 lanes][4] float32 (lane-contiguous: no bank conflicts),
  // then (SPLIT_SUM) their totals [G8][32 lanes][4]
  const u32 red_base = tiles_base + STAGES * TILE_BYTES;
  const u32 red_total = red_base + WARPS * G8 * 32 * 16;
  // (LAZY_MAX) the shared probabilities [G8 / 2 value steps][32 lanes][4] bf16x2, then the
  // query slices (QSMEM) and the mbarriers (BULK)
  const u32 p_slots = red_total + (SPLIT_SUM ? G8 * 32 * 16 : 0);
  const u32 extra_base = p_slots + (LAZY_MAX ? G8 * 32 * 8 : 0);

  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, c = lane & 3;
  // One flat grid, head blocks fastest: the CTAs reading one KV split side by side share
  // its tiles through L2.
  const int head_blocks = (num_heads + 15) / 16;
  const int hb = blockIdx.x % head_blocks;
  const int split = (blockIdx.x / head_blocks) % num_splits;
  const int t = blockIdx.x / (head_blocks * num_splits);
  const int h0 = hb * 16 + g, h1 = h0 + 8;

  // A programmatic launch (PDL) may start before the kernel before it ends: nothing global is
  // read before this wait (a no-op on a plain launch).
  grid_dependency_wait();
  const int seq = tok_seq[t];
  const int length = tok_len[t];  // keys at positions < length are causal
  const int start = tok_start[t];  // and >= start (sliding window)
#if SPARSE
  // Tiles of TILE entries of the token's top-k list (positions), split into equal parts.
  const int base = 0, limit = num_topk;
#else
  // Tiles start at multiples of TILE from start rounded down, so a tile lies in one page.
  const int base = (start / TILE) * TILE, limit = length;
#endif
  const int per_split = ((limit - base + num_splits - 1) / num_splits + TILE - 1) / TILE * TILE;
  const int lo = base + split * per_split;
  const int hi = min(lo + per_split, limit);
  const int num_tiles = hi > lo ? (hi - lo + TILE - 1) / TILE : 0;
  const int* table = block_tables + (long long)seq * bt_stride;

  // The query slice of this warp in the permuted order: a[s][0..3] for MMA step s = 2j + h
  // (QSMEM: kept in shared memory, each lane's 16 bytes of a step side by side).
#if QSMEM
  const u32 q_slots = extra_base + (warp * 2 * CHUNKS * 32 + lane) * 16;
#endif
  u32 qa[QSMEM ? 1 : 2 * CHUNKS][4];
  // (ROPE_BF16) the A fragment of this warp's rope step, in the order of the keys' (rb): query
  // columns RANK + 16 warp + 4c, + 1 (k = 2c, 2c + 1) and + 2, + 3 (k = 2c + 8, 2c + 9) of heads
  // h0 and h1
  u32 qr[4] = {0u, 0u, 0u, 0u};
  const float qk = scale * LOG2E;  // scores -> log2 units
#if BULK
  // one mbarrier per stage, after the query slices, then (SPARSE) each stage's key mask
  const u32 bars = extra_base + (QSMEM ? WARPS * 2 * CHUNKS * 32 * 16 : 0);
#if SPARSE
  const u32 masks = bars + 8 * STAGES;
#endif
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) mbar_init(bars + 8 * s, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
#endif
  {
    const unsigned short* q0 = query + (long long)t * q_stride_t + (long long)h0 * q_stride_h;
    const unsigned short* q1 = query + (long long)t * q_stride_t + (long long)h1 * q_stride_h;
    uint4 r0[CHUNKS], r1[CHUNKS];
#pragma unroll
    for (int j = 0; j < CHUNKS; ++j) {
      const int col = warp * 128 + j * 32 + c * 8;
      // the slots past the record's E4M3 values multiply zeros (and for KIND_E8M0 the
      // query's columns there are its rope, taken by the rope step)
      r0[j] = h0 < num_heads && col < CODES ? *(const uint4*)(q0 + col) : make_uint4(0, 0, 0, 0);
      r1[j] = h1 < num_heads && col < CODES ? *(const uint4*)(q1 + col) : make_uint4(0, 0, 0, 0);
    }
#if ROPE_BF16
    const int rope_col = RANK + 16 * warp + 4 * c;
    if (h0 < num_heads) {
      const uint2 r = *(const uint2*)(q0 + rope_col);
      qr[0] = r.x; qr[2] = r.y;
    }
    if (h1 < num_heads) {
      const uint2 r = *(const uint2*)(q1 + rope_col);
      qr[1] = r.x; qr[3] = r.y;
    }
#endif
    // Step 4p + t pairs value 2t (k = 2c, 2c + 1) and value 2t + 1 (k = 2c + 8, 2c + 9) of
    // the lane's eight in chunk 2p with the same values of chunk 2p + 1, as the decoded
    // registers do.
#pragma unroll
    for (int p = 0; p < CHUNKS / 2; ++p) {
      const u32 a0[4] = {r0[2 * p].x, r0[2 * p].y, r0[2 * p].z, r0[2 * p].w};
      const u32 b0[4] = {r0[2 * p + 1].x, r0[2 * p + 1].y, r0[2 * p + 1].z, r0[2 * p + 1].w};
      const u32 a1[4] = {r1[2 * p].x, r1[2 * p].y, r1[2 * p].z, r1[2 * p].w};
      const u32 b1[4] = {r1[2 * p + 1].x, r1[2 * p + 1].y, r1[2 * p + 1].z, r1[2 * p + 1].w};
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        const u32 step[4] = {__byte_perm(a0[t], b0[t], 0x5410), __byte_perm(a1[t], b1[t], 0x5410),
                             __byte_perm(a0[t], b0[t], 0x7632), __byte_perm(a1[t], b1[t], 0x7632)};
#if QSMEM
        sts128(q_slots + (4 * p + t) * 512, step[0], step[1], step[2], step[3]);
#else
#pragma unroll
        for (int i = 0; i < 4; ++i) qa[4 * p + t][i] = step[i];
#endif
      }
    }
  }

  float acc[CHUNKS][4][4];  // [chunk][(h, b) block][fragment]
#pragma unroll
  for (int j = 0; j < CHUNKS; ++j)
#pragma unroll
    for (int b = 0; b < 4; ++b)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[j][b][i] = 0.f;
  float m0 = NEG_INF, m1 = NEG_INF;  // running max (log2 units) of heads g, g + 8
  // this lane's share of the running sums (LAZY_MAX: of this warp's quarter of the keys)
  float l0 = 0.f, l1 = 0.f;

  // A tile's page index is loaded one iteration before its copies are issued: issuing
  // them stalls this thread until the index arrives, so it must already be there.
  auto page_of = [&](int tile) -> int {
    return tile < num_tiles && (!BULK || tid == 0) ? table[(lo + tile * TILE) >> page_shift]
                                                    : 0;
  };
  const int page_mask = (1 << page_shift) - 1;
  // shared-memory slot of the tile read next (advanced by one slot, wrapping: no division)
  const u32 last_slot = tiles_base + (STAGES - 1) * TILE_BYTES;
  u32 read_slot = tiles_base;
#if BULK && SPARSE
  // Lane k of warp 0 fetches list entry lo + TILE tile + k: its position (-1 when it is past
  // the list or outside [start, length), a key not read) and page, one tile before the copy.
  struct SparseKey { int pos; int page; };
  auto fetch = [&](int tile) -> SparseKey {
    SparseKey key{-1, 0};
    const int entry = lo + tile * TILE + lane;
    if (warp == 0 && tile < num_tiles && lane < TILE && entry < hi) {
      const int pos = topk[(long long)t * topk_stride + entry];
      if (pos >= start && pos < length) key = SparseKey{pos, table[pos >> page_shift]};
    }
    return key;
  };
  // Warp 0 copies a tile: each lane its key's record by one bulk copy on the stage's
  // mbarrier, after lane 0 stored the tile's mask of keys read (bit k: key k; SHIFTED: and of
  // keys whose record starts 8 bytes into its slot) beside the mbarriers and arrived expecting
  // their bytes. The other keys' bytes in the slot are stale: the decode zeroes them (mask bit
  // clear) and masks their scores.
  auto issue = [&](int tile, SparseKey key, u32 slot, u32 bar) {
    if (warp != 0 || tile >= num_tiles) return;
    const u32 mask = __ballot_sync(0xffffffffu, key.pos >= 0);
    const long long off = (long long)(key.pos & page_mask) * BPT;
    const int shift = SHIFTED ? (int)(off & 15) : 0;  // 0 or 8 (BPT is a multiple of 8)
#if SHIFTED
    const u32 shifted = __ballot_sync(0xffffffffu, key.pos >= 0 && shift != 0);
#endif
    // the slot's last reads were generic-proxy loads; the copies write through the async one
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    if (lane == 0) {
      // read after the mbarrier's phase completes, which the arrival below releases
      sts32(masks + (bar - bars) / 2 * MASK_WORDS, mask);
#if SHIFTED
      sts32(masks + (bar - bars) / 2 * MASK_WORDS + 4, shifted);
#endif
      mbar_expect(bar, (u32)__popc(mask) * KEY_BYTES);
    }
    __syncwarp();
    if (key.pos >= 0)
      bulk_copy(slot + lane * KEY_BYTES, cache + (long long)key.page * page_bytes + off - shift,
                KEY_BYTES, bar);
  };
#elif BULK
  auto fetch = page_of;
  // One thread copies the whole tile (it lies in one page) with one bulk copy completing on
  // the stage's mbarrier: TILE * BPT bytes, a multiple of 16 at a 16-byte aligned offset for
  // any record size that is a multiple of 8 (keys outside [start, hi) are zeroed as they are
  // decoded).
  auto issue = [&](int tile, int page, u32 slot, u32 bar) {
    if (tile >= num_tiles || tid != 0) return;
    // the slot's last reads were generic-proxy loads; the copy writes through the async one
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    const int pos = lo + tile * TILE;
    mbar_expect(bar, TILE_BYTES);
    bulk_copy(slot, cache + (long long)page * page_bytes + (long long)(pos & page_mask) * BPT,
              TILE_BYTES, bar);
  };
#endif
#if BULK
#pragma unroll
  for (int s = 0; s < STAGES; ++s) issue(s, fetch(s), tiles_base + s * TILE_BYTES, bars + 8 * s);
  auto next_fetch = fetch(STAGES);
  u32 read_bar = bars, read_phase = 0;
#else
  // copies: 128 / TILE threads per key of a tile, each taking every (128 / TILE)-th chunk
  constexpr int PER_KEY = WARPS * 32 / TILE;
  const int key = tid / PER_KEY, eighth = tid % PER_KEY;
  // This thread's byte offset inside a tile (the same in shared memory and in the page), so
  // that each copy's two addresses are one register plus a constant.
  const u32 thread_off = key * BPT + eighth * 16;
  auto issue = [&](int tile, int page, u32 slot) {
    if (tile < num_tiles) {
      const int pos = lo + tile * TILE;
      const unsigned char* from = cache + (long long)page * page_bytes
                                  + (long long)(pos & page_mask) * BPT + thread_off;
      // keys outside [start, hi) are not read (zero-filled; their decode is zeroed anyway)
      const u32 bytes = key >= start - pos && key < hi - pos ? 16u : 0u;
      const u32 dst = slot + thread_off;
#pragma unroll
      for (int k = 0; k < (BPT / 16 + PER_KEY - 1) / PER_KEY; ++k) {
        if ((BPT / 16) % PER_KEY == 0 || eighth + PER_KEY * k < BPT / 16)
          copy16_fill(dst + PER_KEY * 16 * k, from + PER_KEY * 16 * k, bytes);
      }
    }
    commit();  // an empty group past the end keeps the wait counts uniform
  };
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) issue(s, page_of(s), tiles_base + s * TILE_BYTES);
  int next_page = page_of(STAGES - 1);
  u32 copy_slot = last_slot;  // the slot of the tile copied next
#endif

  for (int tile = 0; tile < num_tiles; ++tile) {
#if BULK
    mbar_wait(read_bar, read_phase);  // the tile's bytes (no barrier: see the first one below)
    const u32 tile_bar = read_bar;
#if SPARSE
    const u32 read_mask = lds32(masks + (tile_bar - bars) / 2 * MASK_WORDS);  // keys read (bit k)
#if SHIFTED
    const u32 read_shifted = lds32(masks + (tile_bar - bars) / 2 * MASK_WORDS + 4);
#endif
#endif
    read_bar = read_slot == last_slot ? bars : read_bar + 8;
    read_phase ^= read_slot == last_slot ? 1u : 0u;
#else
    wait_groups<STAGES - 2>();
    __syncthreads();  // the tile's bytes from every thread's copies; the reduction buffer free
    issue(tile + STAGES - 1, next_page, copy_slot);
    next_page = page_of(tile + STAGES);
    copy_slot = copy_slot == last_slot ? tiles_base : copy_slot + TILE_BYTES;
#endif

    const u32 tb = read_slot;
    read_slot = read_slot == last_slot ? tiles_base : read_slot + TILE_BYTES;
    // where key k's record starts in the tile's slot
    auto record_of = [&](int k) -> u32 {
#if SHIFTED
      return tb + k * KEY_BYTES + ((read_shifted >> k) & 1u) * 8u;
#else
      return tb + k * BPT;
#endif
    };
    // An edge tile (uniform over the CTA) holds keys not to attend: (dense) positions outside
    // [start, hi), (SPARSE) keys not read. Their decoded values are zeroed (whatever their
    // bytes) and their scores set to -inf before anything reads them (LAZY_MAX: as they are
    // summed). masked(k): whether key k of the tile is one.
#if SPARSE
    const bool edge_tile = read_mask != (TILE == 32 ? 0xFFFFFFFFu : 0xFFFFu);
    auto masked = [&](int k) { return ((read_mask >> k) & 1u) == 0u; };
#else
    const int tile_pos = lo + tile * TILE;
    const bool edge_tile = tile_pos < start || tile_pos + TILE > hi;
    auto masked = [&](int k) { return tile_pos + k < start || tile_pos + k >= hi; };
#endif
    // 1. decode: kb[n][2p + i / 4][i % 4], key key_of(g) of group n (key 8n + key_of(g)),
    // value i of chunks 2p (low lane) and 2p + 1 (high lane); rb[n]: its rope step's B
    // fragment (ROPE_BF16: rope values 16 warp + 4c .. + 3, one 8-byte load, their order
    // inside the step permuted as the query's)
    u32 kb[G8][CHUNKS][4];
    u32 rb[G8][2];
    u32 scales[G8];
    // 2. partial scores of this warp's values: sc[n] = S[heads g / g + 8][columns 2c, 2c + 1
    // of group n, i.e. keys 8n + key_of(2c), 8n + key_of(2c + 1)]
    float sc[G8][4];
#pragma unroll
    for (int n = 0; n < G8; ++n) sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.f;
#pragma unroll
    for (int n = 0; n < G8; ++n) {
      const u32 rec = record_of(n * 8 + key_of(g));
      scales[n] = scale_bytes(rec, warp);
      const u32 fb = factor_bytes(scales[n]);
#pragma unroll
      for (int p = 0; p < CHUNKS / 2; ++p) {
        if (pair_has_codes(warp, p)) {
          decode_pair(lds64(rec + warp * 128 + 64 * p + c * 8),
                      lds64(rec + warp * 128 + 64 * p + 32 + c * 8),
                      KIND == KIND_FP32 ? EXACT_FACTORS : p ? pair_factor<1>(fb)
                                                            : pair_factor<0>(fb),
                      kb[n][2 * p], kb[n][2 * p + 1]);
        } else {
#pragma unroll
          for (int r = 0; r < 4; ++r) kb[n][2 * p][r] = kb[n][2 * p + 1][r] = 0u;
        }
      }
#if ROPE_BF16
      const uint2 rope = lds64(rec + ROPE_OFF + warp * 32 + c * 8);
      rb[n][0] = rope.x;
      rb[n][1] = rope.y;
#endif
      if (edge_tile && masked(n * 8 + key_of(g))) scales[n] = 0u;
    }
#if KIND != KIND_FP32
    // Scale bytes above 134 (values past 2^7 * 448) are rare: one vote per tile, and the
    // tile decoded again with two factors where a lane has one.
    u32 large = 0;
#pragma unroll
    for (int n = 0; n < G8; ++n) large |= large_scales(scales[n]);
    if (__any_sync(0xffffffffu, large != 0u)) {
#pragma unroll
      for (int n = 0; n < G8; ++n) {
        const u32 rec = record_of(n * 8 + key_of(g));
#pragma unroll
        for (int p = 0; p < CHUNKS / 2; ++p)
          if (pair_has_codes(warp, p))
            decode_pair_any(lds64(rec + warp * 128 + 64 * p + c * 8),
                            lds64(rec + warp * 128 + 64 * p + 32 + c * 8),
                            (scales[n] >> (16 * p)) & 0xFFu, (scales[n] >> (16 * p + 8)) & 0xFFu,
                            kb[n][2 * p], kb[n][2 * p + 1]);
      }
    }
#endif
    if (edge_tile) {
#pragma unroll
      for (int n = 0; n < G8; ++n) {
        if (masked(n * 8 + key_of(g))) {
#pragma unroll
          for (int j = 0; j < CHUNKS; ++j)
#pragma unroll
            for (int r = 0; r < 4; ++r) kb[n][j][r] = 0u;
          rb[n][0] = rb[n][1] = 0u;
        }
      }
    }
    // (KIND_FP32) ks[n][i]: this warp's multiplier of the key in column 2c + i of group n,
    // zero outside [start, hi) and where the warp has no E4M3 values; 1 for the other kinds
    KeyScales ks;
#pragma unroll
    for (int n = 0; n < G8; ++n)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
#if KIND == KIND_FP32
        const int key = n * 8 + key_of(2 * c + i);
        ks[n][i] = warp * 128 >= CODES || (edge_tile && masked(key))
                       ? 0.f : __uint_as_float(lds32(record_of(key) + SCALE_OFF + warp * 4));
#else
        ks[n][i] = 1.f;
#endif
      }
#pragma unroll
    for (int j = 0; j < CHUNKS; ++j) chunk_scores(j, sc, kb, QUERY_ARGS);
#pragma unroll
    for (int n = 0; n < G8; ++n) {
#if KIND == KIND_FP32
      sc[n][0] *= ks[n][0]; sc[n][1] *= ks[n][1];
      sc[n][2] *= ks[n][0]; sc[n][3] *= ks[n][1];
#endif
#if ROPE_BF16
      mma(sc[n], qr, rb[n][0], rb[n][1]);
#endif
    }
    // 3. the four warps' partial scores added in warp order through shared memory, then
    // scaled to log2 units once: exp2(s - max) below is then exactly 1 at the maximum
    // (exp2(fma(s, qk, -max)) can exceed it by half an ulp of the maximum, past 2^128 for
    // scores near 2^32)
#if SPLIT_SUM
    // Two phases: warp w sums pairs w, w + 4, ... of every lane's 4 * G8 floats over the
    // four partials and publishes them; then every warp reads the totals (half the shared
    // memory reads of each warp reading every partial, one more barrier).
#pragma unroll
    for (int n = 0; n < G8; ++n)
      sts128f(red_base + ((warp * G8 + n) * 32 + lane) * 16, sc[n][0], sc[n][1], sc[n][2],
              sc[n][3]);
    __syncthreads();
#if BULK
    // every warp has read this tile's records (the decode is behind it): its slot takes the
    // tile STAGES ahead
    issue(tile + STAGES, next_fetch, tb, tile_bar);
    // only warp 0 copies: the other warps skip the index loads' address arithmetic
    if (warp == 0) next_fetch = fetch(tile + STAGES + 1);
#endif
    static_assert(2 * G8 % WARPS == 0, "every warp sums the same number of pairs");
    // Pair q: 8-key group q / 2, head g + 8 (q % 2); a warp's pairs share its head (warp % 2).
#if LAZY_MAX
    const float mh = (warp & 1) ? m1 : m0;
    const float zh = mh == NEG_INF ? 0.f : mh;  // no key yet: exp2(-inf - 0) = 0
    bool over = false;
    float quarter_sum = 0.f;
#endif
#pragma unroll
    for (int r = 0; r < 2 * G8 / WARPS; ++r) {  // a fixed count: no loop over a warp index
      const int q = warp + WARPS * r;
      // warp 0's partial first, then the others added in warp order (no 0 + first: an add
      // the compiler must keep, as 0 + -0 is +0)
      const float2 a0 = lds64f(red_base + ((q / 2) * 32 + lane) * 16 + 8 * (q % 2));
      float x = a0.x, y = a0.y;
#pragma unroll
      for (int w = 1; w < WARPS; ++w) {
        const float2 a = lds64f(red_base + ((w * G8 + q / 2) * 32 + lane) * 16 + 8 * (q % 2));
        x += a.x; y += a.y;
      }
      x *= qk; y *= qk;
#if LAZY_MAX
      if (edge_tile) {
        if (masked(8 * (q / 2) + key_of(2 * c))) x = NEG_INF;
        if (masked(8 * (q / 2) + key_of(2 * c + 1))) y = NEG_INF;
      }
      // not within the slack (a NaN score too): the tile takes the full softmax
      over |= !(x <= mh + LAZY_SLACK) || !(y <= mh + LAZY_SLACK);
      const float px = exp2_ftz(x - zh), py = exp2_ftz(y - zh);
      quarter_sum += px + py;
      sts32(p_slots + ((q / 4) * 32 + lane) * 16 + ((q / 2) % 2 * 2 + q % 2) * 4,
            pack_bf16(px, py));
#endif
      sts64f(red_total + ((q / 2) * 32 + lane) * 16 + 8 * (q % 2), x, y);
    }
#if LAZY_MAX
    if (!__syncthreads_or(over)) {
      // every score within the slack of the running max: it stays, nothing is rescaled
      if (warp & 1) l1 += quarter_sum; else l0 += quarter_sum;
      value_products_shared(acc, p_slots, kb, warp, lane, ks);  // 4-5.
      continue;
    }
#else
    __syncthreads();
#endif
    float s[G8][4];
#pragma unroll
    for (int n = 0; n < G8; ++n) {
      const float4 a = lds128f(red_total + (n * 32 + lane) * 16);
      s[n][0] = a.x; s[n][1] = a.y; s[n][2] = a.z; s[n][3] = a.w;
    }
#else
#pragma unroll
    for (int n = 0; n < G8; ++n)
      sts128f(red_base + ((warp * G8 + n) * 32 + lane) * 16, sc[n][0], sc[n][1], sc[n][2],
              sc[n][3]);
    __syncthreads();
    float s[G8][4];
#pragma unroll
    for (int n = 0; n < G8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
#pragma unroll
      for (int n = 0; n < G8; ++n) {
        const float4 a = lds128f(red_base + ((w * G8 + n) * 32 + lane) * 16);
        s[n][0] += a.x; s[n][1] += a.y; s[n][2] += a.z; s[n][3] += a.w;
      }
    }
#pragma unroll
    for (int n = 0; n < G8; ++n) {
      s[n][0] *= qk; s[n][1] *= qk; s[n][2] *= qk; s[n][3] *= qk;
    }
#endif
    // online softmax over the tile's allowed keys (start <= position < hi; LAZY_MAX: the
    // totals were masked as they were summed)
#if !LAZY_MAX
    if (edge_tile) {
#pragma unroll
      for (int n = 0; n < G8; ++n)
#pragma unroll
        for (int i = 0; i < 2; ++i)
          if (masked(8 * n + key_of(2 * c + i))) s[n][i] = s[n][2 + i] = NEG_INF;
    }
#endif
    float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
    for (int n = 0; n < G8; ++n)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        mx0 = fmaxf(mx0, s[n][i]);
        mx1 = fmaxf(mx1, s[n][2 + i]);
      }
#pragma unroll
    for (int o = 1; o < 4; o <<= 1) {
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o));
    }
    const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
    // a head with no allowed key yet keeps -inf: subtract 0 so that exp2 gives 0
    const float z0 = n0 == NEG_INF ? 0.f : n0, z1 = n1 == NEG_INF ? 0.f : n1;
    const float alpha0 = exp2_ftz(m0 - z0), alpha1 = exp2_ftz(m1 - z1);
    m0 = n0; m1 = n1;
    float p[G8][4];
#pragma unroll
    for (int n = 0; n < G8; ++n)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        p[n][i] = exp2_ftz(s[n][i] - z0);
        p[n][2 + i] = exp2_ftz(s[n][2 + i] - z1);
      }
#if LAZY_MAX
    // this warp's quarter: the pairs of its head whose group n has n % 2 == warp / 2
    float own = 0.f;
#pragma unroll
    for (int n = 0; n < G8; ++n)
      if ((n & 1) == (warp >> 1)) own += (warp & 1) ? p[n][2] + p[n][3] : p[n][0] + p[n][1];
    l0 = l0 * alpha0 + ((warp & 1) ? 0.f : own);
    l1 = l1 * alpha1 + ((warp & 1) ? own : 0.f);
#else
    float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
    for (int n = 0; n < G8; ++n) {
      sum0 += p[n][0] + p[n][1];
      sum1 += p[n][2] + p[n][3];
    }
    l0 = l0 * alpha0 + sum0;
    l1 = l1 * alpha1 + sum1;
#endif
    // The running max rarely moves once a few tiles are in: rescale only when it did.
    if (__any_sync(0xffffffffu, alpha0 != 1.f || alpha1 != 1.f)) {
#pragma unroll
      for (int j = 0; j < CHUNKS; ++j)
#pragma unroll
        for (int b = 0; b < 4; ++b) {
          acc[j][b][0] *= alpha0; acc[j][b][1] *= alpha0;
          acc[j][b][2] *= alpha1; acc[j][b][3] *= alpha1;
        }
    }
    value_products(acc, p, kb, warp, ks);  // 4-5.
  }
  // The next programmatic launch (the combine) may start its CTAs once every CTA of ours is
  // past its keys; it waits for our writes in its own grid wait.
  grid_dependents_launch();
#if !BULK
  wait_groups<0>();  // no copy left running when the CTA exits
#endif
#if LAZY_MAX
  // the four warps' quarters of the sums, added in warp order
  __syncthreads();  // every warp is past its last tile's shared-memory reads
  sts64f(red_base + (warp * 32 + lane) * 8, l0, l1);
  __syncthreads();
  l0 = 0.f; l1 = 0.f;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) {
    const float2 v = lds64f(red_base + (w * 32 + lane) * 8);
    l0 += v.x; l1 += v.y;
  }
#endif

  // Totals over the quad; lane (g, c) owns columns 128w + 32j + 8c + i: accumulator block
  // acc[2p + i / 4][i % 4], its low column for chunk j = 2p, its high one for 2p + 1 (the
  // transposed register pairs chunk 2p with 2p + 1) -- see the header.
#pragma unroll
  for (int o = 1; o < 4; o <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, o);
    l1 += __shfl_xor_sync(0xffffffffu, l1, o);
  }
  const float inv0 = l0 > 0.f ? 1.f / l0 : 0.f, inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
  const bool split_out = num_splits > 1;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int h = half ? h1 : h0;
    if (h >= num_heads) continue;
    const float inv = half ? inv1 : inv0;
    const int r = 2 * half;
#pragma unroll
    for (int j = 0; j < CHUNKS; ++j) {
      const int col = warp * 128 + j * 32 + c * 8;
      if (col >= RANK) continue;
      // value i of chunk j: block i of its pair (slot 2 (j / 2) + i / 4, register i % 4),
      // the low column (fragment r) for chunk 2p, the high one (r + 1) for chunk 2p + 1
      float v[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = acc[2 * (j / 2) + i / 4][i % 4][r + j % 2] * inv;
      if (split_out) {
        float* dst = part + (long long)t * part_stride_t + (long long)split * part_stride_s
                     + (long long)h * part_stride_h + col;
        *(float4*)dst = make_float4(v[0], v[1], v[2], v[3]);
        *(float4*)(dst + 4) = make_float4(v[4], v[5], v[6], v[7]);
      } else {
        unsigned short* dst = out + (long long)t * out_stride_t + (long long)h * out_stride_h + col;
        *(uint4*)dst = make_uint4(pack_bf16(v[0], v[1]), pack_bf16(v[2], v[3]),
                                  pack_bf16(v[4], v[5]), pack_bf16(v[6], v[7]));
      }
    }
    if (warp == 0 && c == 0) {
      const float l = half ? l1 : l0;
      const float m = half ? m1 : m0;
      // no key: -inf; a NaN sum (a NaN record) stays NaN, as in the reference
      const float lse = l > 0.f || l != l ? (m + __log2f(l)) * LN2 : NEG_INF;
      plse[(long long)t * plse_stride_t + (long long)split * plse_stride_s + h] = lse;
    }
  }
}
