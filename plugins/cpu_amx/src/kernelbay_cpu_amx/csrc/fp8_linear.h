// Entry points and arguments of the W8A16 / bf16 linear kernels (kernels_impl.h has the code).
//
// Math: y[m, n] = sum_kb s[kb, n / group_n] * sum_{k in block kb} x[m, k] * w[n, k]  (+ bias[n])
// x and w are bf16 (E4M3 -> bf16 is exact), products are exact in fp32 and summed in fp32
// (_mm512_dpbf16_ps, or AMX _tile_dpbf16ps); each K block's fp32 partial sum is multiplied by
// its scale once. Per-tensor scales arrive as an expanded [num_k_blocks, 1] view with stride 0
// along K: the same code path as block scales.
//
// Packed weight layout (made once after loading, kernels.py: pack_weight): tiles of 32 output
// columns; inside a tile, for each pair of K (k = 2p, 2p + 1), two vectors of 16 columns, each
// vector [16 columns][2 k] -- the operand of _mm512_dpbf16_ps and an AMX B tile row:
//   vector v of (tile t, pair p), element 2 j + e  =  w[32 t + 16 v + j][2 p + e]
// bf16 weights store (t, p) as 64 elements: vector 0 then vector 1.
// E4M3 weights store (t, p) as 64 bytes interleaved per 128-bit lane so that one load and the
// in-lane byte unpacks (unpacklo/hi_epi8) yield the two vectors in order: byte 16 L + q holds
// element 8 L + q of vector 0 and byte 16 L + 8 + q element 8 L + q of vector 1 (L, q < 4, 8).
#pragma once

#include <cstdint>

namespace kb_cpu_amx {

struct LinearArgs {
  const uint16_t* x;      // bf16 activations [M, K], row stride ldx
  int64_t ldx;
  const void* w;          // packed weights (uint8 E4M3 or bf16), see above
  bool fp8;               // element type of w
  const float* scale;     // scale view: row kb at scale + kb * scale_kb_stride
  int64_t scale_kb_stride;
  int64_t group_n;        // columns per scale entry: 1 (per row of N) or a multiple of 16
  const float* bias;      // fp32 [N] or nullptr
  void* out;              // [M, N], bf16 or fp32, row stride ldo
  int64_t ldo;
  bool out_fp32;
  int64_t M, N, K;
  int64_t bk;             // K elements per scale block (a multiple of 32, divides K)
};

enum class Path { kDecode, kTiled };

// E4M3 -> bf16 with integer ops + a subnormal LUT (AVX512-BW); bf16 weights pass through.
void linear_base(const LinearArgs& a, Path path, bool use_amx);
// E4M3 -> bf16 with two 128-entry byte tables (vpermi2b, AVX512-VBMI): fewer instructions.
// Only for E4M3 weights, only when the CPU has avx512vbmi (checked by the caller).
void linear_vbmi(const LinearArgs& a, Path path, bool use_amx);

// AMX (amx_tile + amx_bf16): compiled in when the compiler supports it, used only when the CPU
// reports it and the OS granted tile data (arch_prctl ARCH_REQ_XCOMP_PERM).
bool amx_compiled();
bool amx_request_permission();
void tile_config_amx();
void tile_release_amx();
// c[16 * row_tiles x 32] fp32 (row stride 32) = x[16 * row_tiles rows, 32 * ksteps] . B,
// row_tiles 1 or 2; B in the VNNI buffer layout (row = pair of K, 16 columns x 2; vector 1
// starts 32 elements after vector 0).
void amx_block(const uint16_t* x, int64_t ldx, int row_tiles, const uint16_t* b,
               int64_t b_stride_bytes, int64_t ksteps, float* c);

}  // namespace kb_cpu_amx
