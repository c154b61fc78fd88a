// NVFP4 fragment-word decode (and the GEMVs' product of one tile chunk) shared by the CUDA
// kernels of this plugin (the host puts this text in front of each kernel's source before NVRTC
// compiles it: cuda_gemv.cuda_source).
//
// A fragment-order word (linear_triton.layout_tensors) holds eight E2M1 codes; register r
// (0..3) of the word is elements 2r and 2r + 1 of its order as two bf16 lanes reading
// e2m1 * 2^-126 (sign at bit 15, e1 e0 m at bits 8..6), and one fma.rn.bf16x2 by a block's
// multiplier (scale code * 16 + 0x7600 in both lanes, scale_codes.py) makes e2m1 * S * 2^-8,
// exact in bf16.

#pragma once

#include "kernelbay/ptx.cuh"  // u32

// The word layout's constants, defined by the host from kernelbay.formats.e2m1_words
// (cuda_gemv.cuda_source): one layout for the Triton and the CUDA decodes.
#if !defined(E2M1_LANE_MASK) || !defined(E2M1_ROT1) || !defined(E2M1_ROT2) || \
    !defined(E2M1_GATHER_MASK) || !defined(E2M1_GATHER_MULTIPLIER)
#error "the E2M1 word layout's constants come from cuda_gemv.cuda_source"
#endif

// Register r (0..3) of a word: elements 2r and 2r + 1 as bf16 e2m1 * 2^-126 (registers 1 and
// 2: a rotation, one instruction; register 3: three shifted copies added by one multiply).
__device__ __forceinline__ u32 lanes_of(u32 u, int r) {
  const u32 keep = E2M1_LANE_MASK;
  if (r == 0) return u & keep;
  if (r == 1) return __funnelshift_l(u, u, E2M1_ROT1) & keep;
  if (r == 2) return __funnelshift_l(u, u, E2M1_ROT2) & keep;
  return ((u & E2M1_GATHER_MASK) * E2M1_GATHER_MULTIPLIER) & keep;
}

// The bf16 multipliers of two scale codes side by side: bytes b and b + 1 of ``codes`` (b a
// compile-time 0..2) zero-extended into the two 16-bit halves (selector bytes 4: zero), then
// one multiply-add turns each code r into r * 16 + 0x7600 (scale_codes.py): two blocks'
// multipliers for two instructions.
__device__ __forceinline__ u32 multipliers2(u32 codes, int b) {
  return __byte_perm(codes, 0u, 0x4040u | (u32)(b + 1) << 8 | (u32)b) * 0x10u + 0x76007600u;
}

// Two lanes times multiplier h (0 or 1, a compile-time constant) of a pair, plus -0 (zero
// products keep their sign). The broadcast of one half becomes an operand swizzle of the SASS
// multiply (.H0_H0 / .H1_H1), not an instruction of its own.
// (ptxas folds a PTX half move into the swizzle; a byte permute it keeps as an instruction.)
#define KB_SCALED_BY(HALVES)                                                             \
  asm("{\n\t.reg .b16 l, h;\n\t.reg .b32 m;\n\tmov.b32 {l, h}, %2;\n\t"                \
      "mov.b32 m, " HALVES ";\n\tfma.rn.bf16x2 %0, %1, m, %3;\n\t}"                    \
      : "=r"(out) : "r"(lanes), "r"(mults), "r"(0x80008000u))
__device__ __forceinline__ u32 scaled_by(u32 lanes, u32 mults, int h) {
  u32 out;
  if (h == 0) {
    KB_SCALED_BY("{l, l}");
  } else {
    KB_SCALED_BY("{h, h}");
  }
  return out;
}
#undef KB_SCALED_BY

// One mma.sync m16n8k16 with bf16 operands, accumulating in d (fp32).
__device__ __forceinline__ void mma16816(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                         u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 pick(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// One 16-row tile's 128-element chunk times TOKEN_TILES 8-token tiles, as the GEMVs' lane of group
// c = lane % 4 holds them: w[h] the words of its row g + 8h, code[h] that row's two scale codes
// (low bytes), xv[n][q] the four 16-byte pieces of token g + 8n's 32-element group. Step
// s = 2c' + h feeds register pair (2h, 2h + 1) of word c' as fragment registers (a0, a2), the
// matching activation pairs as (b0, b1) (the K order inside the chunk is permuted identically
// for both: a dot product does not care).
template <int TOKEN_TILES>
__device__ __forceinline__ void chunk_mma(float (&acc)[TOKEN_TILES][4], const uint4 (&w)[2],
                                          const u32 (&code)[2],
                                          const uint4 (&xv)[TOKEN_TILES][4]) {
  // both codes' multipliers side by side, one pair per row (half h scales step half h)
  const u32 mult0 = multipliers2(code[0], 0);
  const u32 mult1 = multipliers2(code[1], 0);
#pragma unroll
  for (int cw = 0; cw < 4; ++cw) {
    const u32 u0 = pick(w[0], cw);
    const u32 u1 = pick(w[1], cw);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const u32 a0 = scaled_by(lanes_of(u0, 2 * h), mult0, h);
      const u32 a2 = scaled_by(lanes_of(u0, 2 * h + 1), mult0, h);
      const u32 a1 = scaled_by(lanes_of(u1, 2 * h), mult1, h);
      const u32 a3 = scaled_by(lanes_of(u1, 2 * h + 1), mult1, h);
#pragma unroll
      for (int n = 0; n < TOKEN_TILES; ++n)
        mma16816(acc[n], a0, a1, a2, a3, pick(xv[n][2 * h], cw), pick(xv[n][2 * h + 1], cw));
    }
  }
}

// A warp's accumulators (TILES 16-row tiles x TOKEN_TILES 8-token tiles, the mma.sync C layout)
// into its slab of partial sums [rows][TOKEN_TILES * 8]: tile t's rows start at first_row + 16t.
template <int TILES, int TOKEN_TILES>
__device__ __forceinline__ void store_partials(float* slab,
                                               const float (&acc)[TILES][TOKEN_TILES][4],
                                               int first_row, int lane) {
  const int cols = TOKEN_TILES * 8;
  const int g = lane >> 2;
  const int c = lane & 3;
#pragma unroll
  for (int t = 0; t < TILES; ++t) {
#pragma unroll
    for (int n = 0; n < TOKEN_TILES; ++n) {
      float* p = slab + (first_row + t * 16 + g) * cols + n * 8 + 2 * c;
      p[0] = acc[t][n][0];
      p[1] = acc[t][n][1];
      p[8 * cols] = acc[t][n][2];
      p[8 * cols + 1] = acc[t][n][3];
    }
  }
}
