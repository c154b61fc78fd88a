// NVFP4 weight-only GEMV for M <= 16 (bf16 activations) on sm_90: y[M, N] = x[M, K] W^T, the
// weight streamed by bulk copies (TMA) through a ring of shared-memory stages.
//
// Compiled at run time by NVRTC (cuda_jit.py, cuda_gemv_bulk.build_options) with WN, TM, WK,
// NT, STAGES and KS defined by the host. It reads the "tiles" layout of
// linear_triton.layout_tensors ([N/16, K/128, 256] fragment-order words and [N/16, K/128, 128]
// scale codes: each 16-row tile's 128-element chunks contiguous) and decodes exactly as
// nvfp4_gemv.cu does (nvfp4_lanes.cuh; the same K permutation inside a chunk for weight and
// activations, one mma.sync m16n8k16 per 16 k).
//
// Why a second GEMV: the per-lane copies of nvfp4_gemv.cu keep STAGES - 1 chunks in flight per
// warp, so each warp's chain of chunks waits on memory latency (a 9 MB weight took as long as a
// 19 MB one), and at 16 tokens each warp read its own activations from L2 (more bytes than its
// weight). Here:
// * one producer warp per CTA issues bulk copies of whole stages (each tile's WK chunks of words
//   and codes: two copies per tile; each activation row's slice: one copy per token), so a CTA
//   keeps STAGES stages in flight for the price of a few instructions;
// * the WN x WK consumer warps share each stage's activations from shared memory: warp
//   (wn, wk) takes TM tiles (rows) and chunk wk of every stage (K);
// * the WK partial sums of a tile are added in shared memory in wk order, and the KS CTAs of a
//   thread-block cluster (the split of K, grid y) add theirs through distributed shared memory
//   in rank order: deterministic, no global workspace, one kernel.
// Full stage = one arrival with the expected bytes (the producer), empty stage = one arrival per
// consumer warp, after its lanes hold the stage in registers.

#include "kernelbay/ptx.cuh"  // u32, bulk copies, mbarriers, shared loads
// chunk_mma (decode and mma.sync of one tile chunk) and its helpers: nvfp4_lanes.cuh, which the
// host puts in front of this text.
typedef unsigned short u16;

#ifndef WN
#define WN 4
#endif
#ifndef TM
#define TM 2
#endif
#ifndef WK
#define WK 2
#endif
#ifndef NT
#define NT 1
#endif
#ifndef STAGES
#define STAGES 4
#endif
#ifndef KS
#define KS 1
#endif

#define CONSUMERS (WN * WK)
#define TILES (WN * TM)                  // 16-row tiles per CTA
#define ROWS (TILES * 16)
#define COLS (NT * 8)                    // token columns
#define W_BYTES (TILES * WK * 1024)      // a stage's words: per tile WK chunks of 1 KB
#define C_BYTES (TILES * WK * 128)       // and their codes
// A token row's slice of a stage, padded by 16 bytes so that the eight rows the lanes of a warp
// read at one offset fall in different banks.
#define X_ROW (WK * 256 + 16)
#define STAGE_BYTES (W_BYTES + C_BYTES + COLS * X_ROW)

#if KS > 1
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;"
               ::: "memory");
}

__device__ __forceinline__ u32 cluster_rank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

// A float of CTA ``rank``'s shared memory at this CTA's shared address ``addr``.
__device__ __forceinline__ float ld_cluster(u32 addr, u32 rank) {
  u32 remote;
  float v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
  return v;
}
#endif

extern "C" __global__ void
#if KS > 1
__cluster_dims__(1, KS, 1)
#endif
__launch_bounds__((CONSUMERS + 1) * 32, 1)
nvfp4_gemv_bulk(const u16* __restrict__ x, long long stride_xm, const u32* __restrict__ words,
                const unsigned char* __restrict__ codes, const float* __restrict__ global_scale,
                const u16* __restrict__ bias, u16* __restrict__ out, long long stride_om,
                int M, int N, int K) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) unsigned long long bars[2 * STAGES];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int chunks = K >> 7;
  const int tiles = (N + 15) >> 4;
#if KS > 1
  const int ks = (int)cluster_rank();
#else
  const int ks = 0;
#endif
  // This CTA's chunks [j0, j1) in steps of WK (the last step may be short).
  const int j0 = (ks * chunks) / KS;
  const int j1 = ((ks + 1) * chunks) / KS;
  const int steps = (j1 - j0 + WK - 1) / WK;
  const u32 base = (u32)__cvta_generic_to_shared(smem);
  const u32 full = (u32)__cvta_generic_to_shared(bars);
  const u32 empty = full + 8 * STAGES;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full + 8 * s, 1);
      mbar_init(empty + 8 * s, CONSUMERS);
    }
    mbar_init_fence();
  }
  __syncthreads();

  if (warp == CONSUMERS) {
    // Producer: lane t < TILES copies tile t's words and codes, lane TILES + m token row m.
    // Tiles past the last read the last (valid memory, results not stored).
    const int tile = min(blockIdx.x * TILES + min(lane, TILES - 1), tiles - 1);
    const u32* wsrc = words + ((long long)tile * chunks + j0) * 256;
    const unsigned char* csrc = codes + ((long long)tile * chunks + j0) * 128;
    const int m = lane - TILES;
    const u16* xsrc = x + (long long)(m >= 0 && m < M ? m : 0) * stride_xm + j0 * 128;
    for (int i = 0; i < steps; ++i) {
      const int s = i % STAGES;
      if (i >= STAGES) mbar_wait(empty + 8 * s, ((i / STAGES) - 1) & 1);
      const int n = min(WK, j1 - j0 - i * WK);   // chunks of this step
      const u32 stage = base + s * STAGE_BYTES;
      if (lane == 0) mbar_expect(full + 8 * s, (u32)n * (TILES * 1152 + M * 256));
      __syncwarp();
      if (lane < TILES) {
        bulk_copy(stage + lane * WK * 1024, wsrc + i * WK * 256, n * 1024, full + 8 * s);
        bulk_copy(stage + W_BYTES + lane * WK * 128, csrc + i * WK * 128, n * 128, full + 8 * s);
      } else if (m < M) {
        bulk_copy(stage + W_BYTES + C_BYTES + m * X_ROW, xsrc + i * WK * 128, n * 256,
                  full + 8 * s);
      }
    }
    // falls through to the reductions below (all threads take part in their barriers)
  }

  const int g = lane >> 2;
  const int c = lane & 3;
  const int wn = warp % WN;
  const int wk = warp / WN;
  float acc[TM][NT][4];
#pragma unroll
  for (int t = 0; t < TM; ++t)
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[t][n][i] = 0.f;

  if (warp < CONSUMERS) {
    const int code_shift = (c & 1) * 16;
    // the token rows this lane's B fragments read: past M, the last row (results not stored)
    int xrow[NT];
#pragma unroll
    for (int n = 0; n < NT; ++n) xrow[n] = min(g + 8 * n, M - 1) * X_ROW + wk * 256 + c * 64;
    for (int i = 0; i < steps; ++i) {
      const int s = i % STAGES;
      mbar_wait(full + 8 * s, (i / STAGES) & 1);
      const bool mine = j0 + i * WK + wk < j1;
      const u32 stage = base + s * STAGE_BYTES;
      uint4 w[TM][2];
      u32 code[TM][2];
      uint4 xv[NT][4];
      if (mine) {
#pragma unroll
        for (int t = 0; t < TM; ++t) {
          const int slot = (wn * TM + t) * WK + wk;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            w[t][h] = lds128(stage + slot * 1024 + h * 512 + lane * 16);
            code[t][h] = lds32(stage + W_BYTES + slot * 128 + h * 64 + g * 8 + (c >> 1) * 4)
                         >> code_shift;
          }
        }
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
          for (int q = 0; q < 4; ++q)
            xv[n][q] = lds128(stage + W_BYTES + C_BYTES + xrow[n] + q * 16);
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(empty + 8 * s);
      if (mine) {
#pragma unroll
        for (int t = 0; t < TM; ++t) chunk_mma<NT>(acc[t], w[t], code[t], xv);
      }
    }
  }
  // Every copy has landed and been read (each full phase was waited for): the stages are free.
  __syncthreads();

  // The consumers' partial sums [WK][ROWS][COLS], then their sum in wk order into slab 0.
  float* partial = reinterpret_cast<float*>(smem);
  if (warp < CONSUMERS)
    store_partials<TM, NT>(partial + wk * ROWS * COLS, acc, wn * TM * 16, lane);
  __syncthreads();
  const int threads = (CONSUMERS + 1) * 32;
#if WK > 1
  for (int idx = threadIdx.x; idx < ROWS * COLS; idx += threads) {
    float sum = partial[idx];
#pragma unroll
    for (int w = 1; w < WK; ++w) sum += partial[w * ROWS * COLS + idx];
    partial[idx] = sum;
  }
  __syncthreads();
#endif

  // Rank r of the cluster finishes rows [r * ROWS / KS, (r + 1) * ROWS / KS): the sum of the
  // ranks' slabs in rank order, times weight_scale_2 * 2^8, plus the bias, rounded to bf16.
#if KS > 1
  cluster_sync();
#endif
  const float factor = global_scale[0] * 256.f;
  const int r0 = (ks * ROWS) / KS;
  const int r1 = ((ks + 1) * ROWS) / KS;
  const int row0 = blockIdx.x * ROWS;
  for (int idx = threadIdx.x; idx < (r1 - r0) * COLS; idx += threads) {
    const int r = r0 + idx % (r1 - r0);   // consecutive threads: consecutive output columns
    const int m = idx / (r1 - r0);
    const int n = row0 + r;
    if (n < N && m < M) {
#if KS > 1
      const u32 addr = base + (u32)((r * COLS + m) * 4);
      float sum = 0.f;
#pragma unroll
      for (int q = 0; q < KS; ++q) sum += ld_cluster(addr, q);
#else
      const float sum = partial[r * COLS + m];
#endif
      float v = sum * factor;
      if (bias != nullptr) v += __uint_as_float(((u32)bias[n]) << 16);
      u16 b;
      asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(v));
      out[(long long)m * stride_om + n] = b;
    }
  }
#if KS > 1
  cluster_sync();   // no CTA leaves while another still reads its shared memory
#endif
}
