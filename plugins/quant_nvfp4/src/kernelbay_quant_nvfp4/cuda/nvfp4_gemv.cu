// NVFP4 weight-only GEMV for M <= 16 (bf16 activations), sm_80+: y[M, N] = x[M, K] W^T.
//
// Compiled at run time by NVRTC (cuda_jit.py, cuda_gemv.build_options) with TM, NT, WN, WK,
// STAGES, MIN_BLOCKS and TILED defined by the host. It reads the weight as the Triton
// kernels store it: the fragment-order words of linear_triton.layout_tensors (word c of a
// 32-element group holds elements 2c, 2c+1, 2c+8, 2c+9 and the same plus 16, as bf16 lanes
// after repacked_lanes) and the uint8 scale codes whose bf16 multiplier is code * 16 + 0x7600
// (scale_codes.py, two per register: multipliers2; signs and zeros are folded into the words),
// either in the "tiles" layout (TILED, the default: [N/16, K/128, 256] words and
// [N/16, K/128, 128] codes, each 16-row tile's 128-element chunks contiguous) or in the
// row-major "fragment" layout ([N, K/32, 4] and [N, K/16]).
//
// One CTA owns WN x TM tiles of 16 weight rows and splits K between WK warps per row block;
// a warp runs mma.sync m16n8k16 with the decoded weight as A (16 rows x 16 k) and the
// activations as B (16 k x 8 tokens), NT tiles of 8 tokens. The K index inside a
// 128-element chunk is permuted identically for A and B (a dot product does not care about
// the order): the lane of group c = lane % 4 takes the whole 32-element group 4j + c of
// chunk j, so it loads its weight as one 16-byte vector per row, its activations as four
// 16-byte vectors, and needs two block scales per row and chunk. Step s = 2c' + h of the
// chunk feeds register pair (2h, 2h + 1) of word c' as fragment registers (a0, a2) --
// actual k offsets 16h + 2c' + {0, 1} and 16h + 8 + 2c' + {0, 1} of the group -- and the
// matching pairs of the activation row as (b0, b1). The weight and its codes go through
// shared memory by cp.async, STAGES - 1 chunks ahead, each lane into its own slots.
//
// The WK partial sums of a row block are added in K order through shared memory (the result
// does not depend on scheduling), times weight_scale_2 * 2^8 (the decoded lanes are
// e2m1 * S * 2^-8), plus the bias, rounded once to bf16.

#include "kernelbay/ptx.cuh"  // u32, copies, shared loads
// chunk_mma (decode and mma.sync of one tile chunk) and its helpers: nvfp4_lanes.cuh, which the
// host puts in front of this text.
typedef unsigned short u16;

#ifndef TM
#define TM 2
#endif
#ifndef NT
#define NT 1
#endif
#ifndef WK
#define WK 8
#endif
#ifndef WN
#define WN 1
#endif
#ifndef STAGES
#define STAGES 4
#endif
#if STAGES % 2
#error "STAGES must be even (two activation buffers alternate)"
#endif
#ifndef TILED
#define TILED 1
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 2
#endif
#ifndef EARLY_RELEASE
#define EARLY_RELEASE 0  // programmatic launches: release the next one at the start, not after the K loop
#endif

// Asynchronous copies (kernelbay/ptx.cuh) go into this lane's own shared-memory slots (no
// other lane reads them, so waiting for the lane's own copy groups is enough).

__device__ __forceinline__ uint4 load_cached(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

extern "C" __global__ void __launch_bounds__(WN * WK * 32, MIN_BLOCKS)
nvfp4_gemv(const u16* __restrict__ x, long long stride_xm, const u32* __restrict__ words,
           const unsigned char* __restrict__ codes, const float* __restrict__ global_scale,
           const u16* __restrict__ bias, u16* __restrict__ out, long long stride_om,
           int M, int N, int K) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int wn = warp % WN;                  // which TM tiles of the CTA's rows
  const int wk = warp / WN;                  // which part of K
  const int g = lane >> 2;
  const int c = lane & 3;
  const int groups = K >> 5;                 // 32-element groups per row
  const int chunks = K >> 7;                 // 128-element chunks (K % 128 == 0)
  const int j_begin = (wk * chunks) / WK;
  const int j_end = ((wk + 1) * chunks) / WK;
  const int tiles = (N + 15) >> 4;

  // This lane's pointers at chunk j_begin. TILED: the "tiles" layout (each 16-row tile's
  // chunks one after the other, a chunk's 16 rows x 64 bytes of words and 16 x 8 bytes of
  // codes contiguous), so a warp's copy of a chunk row half is 512 contiguous bytes and a
  // warp streams through one contiguous region per tile; otherwise the row-major
  // "fragment" layout. Tiles past the last read the last (valid memory, results not stored);
  // token rows past M read row 0: they only feed output columns that are never stored.
  const u32* wp[TM][2];
  const unsigned char* cp[TM][2];
#pragma unroll
  for (int t = 0; t < TM; ++t) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int tile = min((blockIdx.x * WN + wn) * TM + t, tiles - 1);
#if TILED
      const long long slab = ((long long)tile * chunks + j_begin) * 2 + h;
      wp[t][h] = words + slab * 128 + g * 16 + c * 4;
      cp[t][h] = codes + slab * 64 + g * 8 + (c >> 1) * 4;
#else
      const long long row = min(tile * 16 + g + 8 * h, N - 1);
      wp[t][h] = words + row * (groups * 4) + (4 * j_begin + c) * 4;
      // the aligned 4 bytes holding this lane's two codes (K % 64 == 0: rows 4-aligned)
      cp[t][h] = codes + row * (groups * 2) + j_begin * 8 + (c >> 1) * 4;
#endif
    }
  }
#if TILED
  const int word_step = 256;   // per chunk: words and code bytes
  const int code_step = 128;
#else
  const int word_step = 16;
  const int code_step = 8;
#endif
  const int code_shift = (c & 1) * 16;
  const u16* xp[NT];
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    int m = g + 8 * n;
    xp[n] = x + (long long)(m < M ? m : 0) * stride_xm + j_begin * 128 + c * 32;
  }

  // This warp's slots: STAGES x (TM x 2 rows) of 16-byte words and 4-byte codes per lane;
  // stage s holds chunks j_begin + s, j_begin + s + STAGES, ...
  const u32 base = (u32)__cvta_generic_to_shared(smem);
  const u32 wslot = base + warp * (STAGES * TM * 2 * 512) + lane * 16;
  const u32 cslot = base + WN * WK * (STAGES * TM * 2 * 512) + warp * (STAGES * TM * 2 * 128)
                    + lane * 4;

  // Copies of chunk j_begin + i (i relative to the pointers) into stage i % STAGES.
  auto fetch = [&](int i) {
    const int stage = i % STAGES;
#pragma unroll
    for (int t = 0; t < TM; ++t) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int slot = (stage * TM + t) * 2 + h;
        copy16(wslot + slot * 512, wp[t][h] + i * word_step);
        copy4(cslot + slot * 128, cp[t][h] + i * code_step);
      }
    }
  };

  auto load_x = [&](uint4 (&xv)[NT][4], int i) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
      for (int q = 0; q < 4; ++q) xv[n][q] = load_cached(xp[n] + i * 128 + q * 8);
    }
  };

  float acc[TM][NT][4];
#pragma unroll
  for (int t = 0; t < TM; ++t)
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[t][n][i] = 0.f;

  const int count = j_end - j_begin;
  // A programmatic launch (PDL) may start while the kernel before it runs: the weight is
  // read-only, so its first stages are copied before the wait, the activations (and every
  // write) after it. EARLY_RELEASE lets the next programmatic launch start its CTAs now.
#if EARLY_RELEASE
  grid_dependents_launch();
#endif
#pragma unroll
  for (int d = 0; d < STAGES - 1; ++d) {
    if (d < count) fetch(d);
    commit();
  }
  grid_dependency_wait();
  uint4 xv[2][NT][4];   // chunk i's activations in xv[i % 2] (STAGES is even)
  if (count > 0) load_x(xv[0], 0);

  for (int i0 = 0; i0 < count; i0 += STAGES) {
#pragma unroll
    for (int d = 0; d < STAGES; ++d) {
      if (i0 + d < count) {
        wait_groups<STAGES - 2>();
        uint4 w[TM][2];
        u32 code[TM][2];
#pragma unroll
        for (int t = 0; t < TM; ++t) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int slot = (d * TM + t) * 2 + h;
            w[t][h] = lds128(wslot + slot * 512);
            code[t][h] = lds32(cslot + slot * 128) >> code_shift;
          }
        }
        if (i0 + d + 1 < count) load_x(xv[(d + 1) % 2], d + 1);
        // into the stage of the previous chunk, read in the previous step
        if (i0 + d + STAGES - 1 < count) fetch(d + STAGES - 1);
        commit();
#pragma unroll
        for (int t = 0; t < TM; ++t) chunk_mma<NT>(acc[t], w[t], code[t], xv[d % 2]);
      }
    }
#pragma unroll
    for (int t = 0; t < TM; ++t)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        wp[t][h] += STAGES * word_step;
        cp[t][h] += STAGES * code_step;
      }
#pragma unroll
    for (int n = 0; n < NT; ++n) xp[n] += STAGES * 128;
  }
#if !EARLY_RELEASE
  // The next programmatic launch may start its CTAs once every CTA of ours is past its loop.
  grid_dependents_launch();
#endif
  wait_groups<0>();
  __syncthreads();

  // Partial sums of the WK warps of each row block, added in K order.
  float* partial = reinterpret_cast<float*>(smem);
  const int cols = NT * 8;
  const int rows = WN * TM * 16;
  store_partials<TM, NT>(partial + wk * rows * cols, acc, wn * TM * 16, lane);
  __syncthreads();
  const float factor = global_scale[0] * 256.f;
  const int row0 = blockIdx.x * rows;
  for (int idx = threadIdx.x; idx < rows * cols; idx += WN * WK * 32) {
    const int r = idx % rows;   // consecutive threads: consecutive output columns
    const int m = idx / rows;
    const int n = row0 + r;
    if (n < N && m < M) {
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < WK; ++w) sum += partial[(w * rows + r) * cols + m];
      float v = sum * factor;
      if (bias != nullptr) v += __uint_as_float(((u32)bias[n]) << 16);
      u16 b;
      asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(v));
      out[(long long)m * stride_om + n] = b;
    }
  }
}
