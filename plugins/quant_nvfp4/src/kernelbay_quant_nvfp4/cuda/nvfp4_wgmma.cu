// NVFP4 weight-only GEMM for sm_90a (bf16 activations): y[M, N] = x[M, K] W^T,
// computed transposed (y^T = W x^T) with wgmma: the weight is the register operand, decoded by
// each thread straight into the registers it multiplies, the activations the shared-memory
// operand, copied in as they are.
//
// Compiled at run time by NVRTC for sm_90a (cuda_wgmma.py) after nvfp4_lanes.cuh (the shared
// fragment-word decode) and the wgmma_k16 wrapper the host writes for NTOK tokens
// (cuda_wgmma.mma_source), with WG, NTOK, STAGES and MIN_BLOCKS defined by the host.
// It reads the weight in the "tiles" layout of linear_triton.layout_tensors: fragment-order
// words [N/16, K/128, 256] and scale codes [N/16, K/128, 128] (each 16-row tile's 128-element
// chunks contiguous; in a chunk, rows 0-7 then 8-15, each row's four 32-element groups of four
// words; word c of a group holds elements 2c, 2c+1, 2c+8, 2c+9 and the same plus 16). Those
// are exactly the elements lane (g, t = c) of an m16n8k16 / wgmma A fragment holds over the
// group's two k16 steps, so a thread's registers come from its own words with no data moved
// between threads.
//
// A CTA owns WG x 64 weight rows (warp w decodes 16-row tile w) and NTOK tokens, and walks K
// in 128-element chunks through a ring of STAGES shared-memory slots. The activations of a
// chunk come by two bulk tensor copies (TMA, the map built by the host: 64 elements x NTOK
// rows each, 128-byte swizzled as wgmma reads them, rows past M zero-filled), issued by one
// thread and completing on the slot's "full" mbarrier; each warp copies its own tile's words
// and codes by cp.async and reads them alone (no CTA barrier in the loop). Each chunk is two
// halves of 64 elements, each half one wgmma group of four k16 steps, and the halves take three
// register sets in turn: while half h's group runs on the tensor cores (and half h + 1's is
// decoded and waiting), the warps decode half h + 2 into the set that half h - 1 used, retired
// by the wait after issuing half h. So decode and matrix work overlap inside every warpgroup,
// and no set is written while a wgmma reads it (nor anything else a pending group reads:
// ptxas would serialize the groups). A warp that retired a chunk arrives on the slot's "empty"
// mbarrier; the copying thread refills a slot once every warp has (two chunks behind, so a
// slow warpgroup rarely holds it up).
//
// The fp32 accumulators run the CTA's K range (one order: deterministic), times weight_scale_2
// * 2^8 (the decoded lanes are e2m1 * S * 2^-8); with one K range (gridDim.z == 1) plus the
// bias, rounded once to bf16; with several (split K: CTA z takes chunks [z per, (z+1) per))
// as fp32 partials [z, M, N] that the host sums in split order.
//
// STREAM_K = 1 balances the work of a grid whose CTAs would leave SMs idle or run a partial
// second wave (28672 rows in 256-row CTAs: 112 CTAs on 132 SMs): the (CTA row tile r, chunk c)
// units u = r C + c of the whole layer are cut into gridDim.y = P equal ranges, CTA p taking
// [floor(p U / P), floor((p + 1) U / P)). A range crosses tile boundaries; at each, the
// accumulators of the tile's segment go out as fp32 partials and start again from zero.
// Segment s of CTA p (s = its tile minus the tile of its first unit) goes to
// partial[p, s, m, row of the CTA tile] (per_split segments per CTA at most); the host's fix-up
// kernel adds each tile's segments in K order (CTA order), adds the bias and rounds.

typedef unsigned short u16;
typedef unsigned long long u64;

#ifndef WG
#define WG 2
#endif
#ifndef NTOK
#define NTOK 128
#endif
#ifndef STAGES
#define STAGES 4
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 1
#endif
#ifndef STREAM_K
#define STREAM_K 0
#endif
#if STAGES < 3
#error "STAGES must be >= 3 (the activations are refilled two chunks behind)"
#endif
#ifndef UNROLL
#define UNROLL 3  // steps per turn of the K loop: a multiple of the three register sets
#endif
#if UNROLL % 3
#error "UNROLL must be a multiple of 3 (the register sets turn every three steps)"
#endif
#if NTOK % 8 || NTOK > 256
#error "NTOK must be a multiple of 8 (the swizzle's 8-row groups), at most 256"
#endif

#define THREADS (WG * 128)
#define X_STAGE (NTOK * 256)             // activation bytes per chunk (two 64-element halves)
#define W_WORDS (WG * 4 * 1024)          // word bytes per chunk: 1 KB per 16-row tile
#define W_STAGE (W_WORDS + WG * 4 * 128) // plus 128 code bytes per tile

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");
}
// Keep the compiler from moving an accumulator's use across a wgmma wait, or an operand's
// computation past the fence that opens a wgmma group (ptxas then serializes the group).
__device__ __forceinline__ void pin(float& v) { asm volatile("" : "+f"(v) :: "memory"); }
__device__ __forceinline__ void pin(u32& v) { asm volatile("" : "+r"(v) :: "memory"); }
__device__ __forceinline__ void pin(u64& v) { asm volatile("" : "+l"(v) :: "memory"); }

// The shared-memory descriptor of a K-major, 128-byte swizzled operand: 8-row groups 1024
// bytes apart (stride byte offset), the leading offset unused for swizzled K-major layouts.
__device__ __forceinline__ u64 operand_desc(u32 addr) {
  return (u64)((addr & 0x3FFFF) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) |
         ((u64)1 << 62);
}

// A CUtensorMap (kernelbay.cuda_jit.tensor_map_2d).
struct __align__(64) TensorMap { u64 bits[16]; };

extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
nvfp4_wgmma(const __grid_constant__ TensorMap xmap, const u32* __restrict__ words,
            const unsigned char* __restrict__ codes, const float* __restrict__ global_scale,
            const u16* __restrict__ bias, u16* __restrict__ out, long long stride_om,
            float* __restrict__ partial, int M, int N, int K, int per_split) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;               // warp w of warpgroup w / 4 owns 16-row tile w
  const int g = lane >> 2;
  const int t = lane & 3;
#if STREAM_K
  const int tiles = (N + 15) >> 4;
  const int tok0 = blockIdx.x * NTOK;
  const long long tile_chunks = K >> 7;
  // This CTA's units [u0, u0 + chunks) (the host gives every CTA at least one).
  const u32 C = (u32)tile_chunks;
  const u32 U = (u32)((tiles + WG * 4 - 1) / (WG * 4)) * C;
  const u32 P = gridDim.y;
  const u32 u0 = (u32)((unsigned long long)blockIdx.y * U / P);
  const int chunks = (int)((unsigned long long)(blockIdx.y + 1) * U / P - u0);
  const int c0 = 0;
  const u32 c_first = u0 % C;   // the chunk of its tile the range starts at
  // Where this warp's weight copies and thread 0's activation copies are: the unit's CTA row
  // tile and chunk, advanced one unit per copy (both go through the units in order).
  u32 wr = u0 / C, wc = c_first;
  u32 xc = c_first;
  auto tile_of = [&](u32 r) {
    // Tiles past the last read the last (valid memory; their rows are not stored).
    return (long long)min((int)r * (WG * 4) + warp, tiles - 1);
  };
  long long tile = tile_of(wr);
  int row_tile = (int)wr * (WG * 4) + warp;
#else
  // This CTA's K range: chunks [c0, c0 + chunks) (the host makes none empty).
  const int c0 = blockIdx.z * per_split;
  const int chunks = min(per_split, (K >> 7) - c0);
  const int tiles = (N + 15) >> 4;
  const int tok0 = blockIdx.x * NTOK;
  const int row_tile = blockIdx.y * (WG * 4) + warp;
  // Tiles past the last read the last (valid memory; their rows are not stored).
  const long long tile = min(row_tile, tiles - 1);
#endif

  // The swizzle needs 1024-byte aligned activation slots (the host adds 1 KB of slack).
  const u32 base = ((u32)__cvta_generic_to_shared(smem) + 1023u) & ~1023u;
  const u32 xs = base;                          // STAGES x X_STAGE
  const u32 ws = base + STAGES * X_STAGE;       // STAGES x W_STAGE
  const u32 full = ws + STAGES * W_STAGE;       // STAGES mbarriers: a slot's activations landed
  const u32 empty = full + STAGES * 8;          // STAGES mbarriers: every warp retired the slot

  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full + s * 8, 1);
      mbar_init(empty + s * 8, WG * 4);
    }
    mbar_init_fence();
  }
  __syncthreads();

  // Chunk j's activations into its slot (thread 0).
  auto load_x = [&](u32 j, u32 slot) {
    const u32 bar = full + slot * 8;
    mbar_expect(bar, X_STAGE);
#if STREAM_K
    const int k0 = xc * 128;
    if (++xc == C) xc = 0;
    bulk_tensor_2d(xs + slot * X_STAGE, &xmap, k0, tok0, bar);
    bulk_tensor_2d(xs + slot * X_STAGE + NTOK * 128, &xmap, k0 + 64, tok0, bar);
#else
    bulk_tensor_2d(xs + slot * X_STAGE, &xmap, (c0 + j) * 128, tok0, bar);
    bulk_tensor_2d(xs + slot * X_STAGE + NTOK * 128, &xmap, (c0 + j) * 128 + 64, tok0, bar);
#endif
  };

  // Weight: each warp copies its own tile's chunk (1 KB of words: 16-byte pieces lane and
  // lane + 32; 128 code bytes: lanes 0-7). Piece u = 32h + 4r + grp (row r of half h, group
  // grp) goes to 32h + 4r + (grp ^ (r / 2 % 4)), so that the eight rows' reads of one group
  // fall in distinct banks.
  u32 wdst[2];
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const int u = lane + 32 * q;
    const int r = (u >> 2) & 7;
    wdst[q] = warp * 1024 + ((u & ~3) + ((u & 3) ^ ((r >> 1) & 3))) * 16;
  }
#if STREAM_K
  const u32* wsrc = words + (tile * tile_chunks + wc) * 256 + lane * 4;
  const unsigned char* csrc = codes + (tile * tile_chunks + wc) * 128 + lane * 16;
#else
  const long long tile_chunks = K >> 7;
  const u32* wsrc = words + (tile * tile_chunks + c0) * 256 + lane * 4;
  const unsigned char* csrc = codes + (tile * tile_chunks + c0) * 128 + lane * 16;
#endif

  auto fetch_w = [&](u32 j, u32 slot) {   // chunk j's weight into its slot, then commit
    if (j < (u32)chunks) {
      const u32 wb = ws + slot * W_STAGE;
      copy16(wb + wdst[0], wsrc);
      copy16(wb + wdst[1], wsrc + 128);
      copy16_if(lane < 8, wb + W_WORDS + warp * 128 + lane * 16, csrc);
      wsrc += 256;   // running pointers: no 64-bit address arithmetic per chunk
      csrc += 128;
#if STREAM_K
      if (++wc == C) {   // on to the next CTA row tile's first chunk
        wc = 0;
        const long long next = tile_of(++wr);
        wsrc = words + next * tile_chunks * 256 + lane * 4;
        csrc = codes + next * tile_chunks * 128 + lane * 16;
      }
#endif
    }
    commit();
  };

  // This thread's reads in a weight slot: word t of piece (32h + 4g + (grp ^ swz)), and the
  // eight codes of row g (h = 0) or g + 8 (h = 1).
  const int swz = (g >> 1) & 3;
  const u32 wread = warp * 1024 + g * 64 + t * 4;
  const u32 cread = W_WORDS + warp * 128 + g * 8;

  // Half q (groups 2q, 2q + 1) of chunk j's weight into fragment registers: k16 step s of
  // the half (group 2q + s / 2, hh = s % 2) takes register pairs (2hh, 2hh + 1) of the
  // group's words as (a0, a2) for row g and (a1, a3) for row g + 8, scaled by block 4q + s.
  struct Raw {        // a half's codes (rows g and g + 8) and words (two groups, two rows)
    u32 c0, c1, u[2][2];
  };
  auto load_half = [&](u32 slot, int q) {
    const u32 wb = ws + slot * W_STAGE;
    Raw raw;
    raw.c0 = lds32(wb + cread + 4 * q);
    raw.c1 = lds32(wb + cread + 64 + 4 * q);
#pragma unroll
    for (int gi = 0; gi < 2; ++gi) {
      const u32 off = wread + (((2 * q + gi) ^ swz) << 4);
      raw.u[gi][0] = lds32(wb + off);
      raw.u[gi][1] = lds32(wb + off + 512);
    }
    return raw;
  };
  auto unpack = [&](u32 (&a)[4][4], const Raw& raw) {
#pragma unroll
    for (int gi = 0; gi < 2; ++gi) {
      // the multipliers of steps 2gi and 2gi + 1 side by side, one pair per row
      const u32 m0 = multipliers2(raw.c0, 2 * gi);
      const u32 m1 = multipliers2(raw.c1, 2 * gi);
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int s = 2 * gi + hh;
        a[s][0] = scaled_by(lanes_of(raw.u[gi][0], 2 * hh), m0, hh);
        a[s][1] = scaled_by(lanes_of(raw.u[gi][1], 2 * hh), m1, hh);
        a[s][2] = scaled_by(lanes_of(raw.u[gi][0], 2 * hh + 1), m0, hh);
        a[s][3] = scaled_by(lanes_of(raw.u[gi][1], 2 * hh + 1), m1, hh);
      }
    }
  };
  auto decode = [&](u32 (&a)[4][4], u32 slot, int q) { unpack(a, load_half(slot, q)); };

  float acc[NTOK / 2];
#pragma unroll
  for (int i = 0; i < NTOK / 2; ++i) acc[i] = 0.f;
#if STREAM_K
  bool fresh = true;   // the next group starts a segment
#endif

  // Half q of chunk j as one wgmma group of four k16 steps: step s reads activation half q
  // at byte 32 s. The operands are pinned before the fence so that nothing defining them is
  // scheduled inside the group (ptxas would serialize it).
  auto issue = [&](u32 (&a)[4][4], u32 slot, int q) {
    // Step s starts 32 bytes (two 16-byte units of the descriptor's address field) after step
    // s - 1; the field cannot carry over (shared addresses stay below 2^18).
    const u64 desc0 = operand_desc(xs + slot * X_STAGE + q * (NTOK * 128));
    u64 desc[4];
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      desc[s] = desc0 + 2 * s;
      pin(desc[s]);
#pragma unroll
      for (int r = 0; r < 4; ++r) pin(a[s][r]);
    }
    wgmma_fence();
#if STREAM_K
    // A segment's first step overwrites the accumulators (they are never written in the loop:
    // ptxas would serialize every group).
    wgmma_k16(acc, a[0][0], a[0][1], a[0][2], a[0][3], desc[0], fresh ? 0u : 1u);
    fresh = false;
#pragma unroll
    for (int s = 1; s < 4; ++s) wgmma_k16(acc, a[s][0], a[s][1], a[s][2], a[s][3], desc[s]);
#else
#pragma unroll
    for (int s = 0; s < 4; ++s) wgmma_k16(acc, a[s][0], a[s][1], a[s][2], a[s][3], desc[s]);
#endif
    wgmma_commit();
  };

#if STREAM_K
  const float factor = global_scale[0] * 256.f;
  // The segment of the consumer's tile ends: its accumulators to partial[p, s] (rows of the
  // CTA tile past N are not written), then the accumulators start again from zero.
  auto flush = [&]() {
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < NTOK / 2; ++i) pin(acc[i]);
    const u32 seg = (u32)row_tile / (WG * 4) - u0 / C;
    float* dst = partial + ((long long)blockIdx.y * per_split + seg) * M * (WG * 64);
    const int row = row_tile * 16 + g;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (row + 8 * h >= N) continue;
      const int in_tile = (warp * 16 + g + 8 * h);
#pragma unroll
      for (int i = 0; i < NTOK / 8; ++i) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int m = tok0 + 8 * i + 2 * t + e;
          if (m < M) dst[(long long)m * (WG * 64) + in_tile] = acc[4 * i + 2 * h + e] * factor;
        }
      }
    }
    fresh = true;
    row_tile += WG * 4;
  };
#endif

  // Until this warp's copies of chunk j + 1's weight have landed (committed: chunks up to
  // j + STAGES; before the loop: chunk 0's, committed up to STAGES - 1).
  auto weights_landed = [&]() {
    wait_groups<STAGES - 1>();
    __syncwarp();
  };

  // A programmatic launch (PDL) may start while the kernel before it runs: the weight is
  // read-only, so its first stages are copied before the wait, the activations (and every
  // write) after it. The next programmatic launch may start its CTAs as soon as ours run.
  grid_dependents_launch();
#pragma unroll
  for (u32 j = 0; j < STAGES; ++j) fetch_w(j, j);
  grid_dependency_wait();
  if (tid == 0) {
    for (u32 j = 0; j < STAGES && j < (u32)chunks; ++j) load_x(j, j);
  }
  // Three register sets for the halves h = 2j + q in turn (set h % 3).
  u32 r0[4][4];
  u32 r1[4][4];
  u32 r2[4][4];
  weights_landed();   // chunk 0's
  decode(r0, 0, 0);
  decode(r1, 0, 1);
  // The slot of chunk j + d, given chunk j's slot s. The steps below take their chunk's slot
  // as an argument: where the loop's turn of UNROLL steps is a multiple of the stages (three
  // stages, as many as the register sets; or six stages and six steps), step t of a turn has
  // the constant slot t % STAGES and every slot address folds into an immediate.
  auto slot_plus = [](u32 s, int d) { return (u32)(((int)s + d + STAGES) % STAGES); };
  // Chunk j's slot in a step that runs as step t of a turn (j = t mod UNROLL).
  auto slot_of = [](u32 j, u32 t) { return UNROLL % STAGES == 0 ? t % STAGES : j % STAGES; };

  // Step j: chunk j's halves in sets (a, b), chunk j + 1's decoded into (c, a). Chunk j's
  // weight slot s is free (decoded in step j - 1): chunk j + STAGES's weight goes there. After
  // the first wait chunk j - 1 is retired: this warp releases its slot, and thread 0 refills
  // the slot of chunk j - 2 (released by every warp in step j - 1, unless one lags behind).
  auto step = [&](u32 (&a)[4][4], u32 (&b)[4][4], u32 (&c)[4][4], u32 j, u32 s) {
    __syncwarp();   // every lane's reads of chunk j's weight slot before the copies refill it
    fetch_w(j + STAGES, s);
    weights_landed();
    mbar_wait(full + s * 8, (j / STAGES) & 1);
    // The next chunk's words and codes are read before each group is issued, so that their
    // latency passes during the wait (3% faster at N = K = 8192, M = 256 than after).
    const bool more = j + 1 < (u32)chunks;
    const u32 s1 = slot_plus(s, 1);
    Raw next;
    if (more) next = load_half(s1, 0);
    issue(a, s, 0);
    wgmma_wait<1>();
    if (j >= 1 && lane == 0) mbar_arrive(empty + slot_plus(s, -1) * 8);
    if (tid == 0 && j >= 2 && j - 2 + STAGES < (u32)chunks) {
      const u32 s2 = slot_plus(s, -2);
      mbar_wait(empty + s2 * 8, ((j - 2) / STAGES) & 1);
      load_x(j - 2 + STAGES, s2);
    }
    if (more) {
      unpack(c, next);
      next = load_half(s1, 1);
    }
    issue(b, s, 1);
    wgmma_wait<1>();
    if (more) unpack(a, next);
  };
#if STREAM_K
  // One segment at a time, so that no accumulator is read inside the loop that issues the
  // groups (ptxas would serialize them); the copies and decodes run on across segments, the
  // register sets turning with the chunk index.
  for (u32 j = 0; j < (u32)chunks;) {
    // the first segment runs to the end of the range's first tile, the others a whole tile
    const u32 end = min((u32)chunks, j + C - (j == 0 ? c_first : 0));
    for (; j < end; ++j) {
      const u32 phase = j % 3;
      // (stream K turns three steps at a time, UNROLL = 3: constant slots with three stages)
      if (phase == 0) {
        step(r0, r1, r2, j, slot_of(j, 0));
      } else if (phase == 1) {
        step(r2, r0, r1, j, slot_of(j, 1));
      } else {
        step(r1, r2, r0, j, slot_of(j, 2));
      }
    }
    flush();
  }
  wait_groups<0>();
#else
  // Turns of UNROLL steps (cuda_wgmma.WgmmaConfig.turn: twelve for four stages, so that each
  // step's slot is a constant; 9-12% fewer loop instructions and 2.5-6% faster at 64 and 128
  // tokens on the H200 than turns of three). The turn of three is spelled out: the generic
  // form scheduled 2% more instructions there.
  for (u32 j = 0; j < (u32)chunks; j += UNROLL) {
#if UNROLL == 3
    step(r0, r1, r2, j, slot_of(j, 0));
    if (j + 1 < (u32)chunks) step(r2, r0, r1, j + 1, slot_of(j + 1, 1));
    if (j + 2 < (u32)chunks) step(r1, r2, r0, j + 2, slot_of(j + 2, 2));
#else
#pragma unroll
    for (u32 t = 0; t < UNROLL; t += 3) {
      if (t == 0 || j + t < (u32)chunks) step(r0, r1, r2, j + t, slot_of(j + t, t));
      if (j + t + 1 < (u32)chunks) step(r2, r0, r1, j + t + 1, slot_of(j + t + 1, t + 1));
      if (j + t + 2 < (u32)chunks) step(r1, r2, r0, j + t + 2, slot_of(j + t + 2, t + 2));
    }
#endif
  }
  wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < NTOK / 2; ++i) pin(acc[i]);
  wait_groups<0>();

  // acc[4i + e]: row g (e < 2) or g + 8, token 8i + 2t + e % 2.
  const float factor = global_scale[0] * 256.f;
  const int row = row_tile * 16 + g;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int n = row + 8 * h;
    if (n >= N) continue;
    const float b = bias != nullptr ? __uint_as_float(((u32)bias[n]) << 16) : 0.f;
#pragma unroll
    for (int i = 0; i < NTOK / 8; ++i) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int m = tok0 + 8 * i + 2 * t + e;
        if (m < M) {
          if (partial != nullptr) {
            partial[((long long)blockIdx.z * M + m) * N + n] = acc[4 * i + 2 * h + e] * factor;
          } else {
            u16 v;
            asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(v) : "f"(acc[4 * i + 2 * h + e] * factor + b));
            out[(long long)m * stride_om + n] = v;
          }
        }
      }
    }
  }
#endif
}
