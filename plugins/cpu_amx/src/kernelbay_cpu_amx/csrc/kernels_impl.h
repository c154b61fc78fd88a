// The kernel templates, included by linear_base.cpp and linear_vbmi.cpp (each instantiates its
// own copy with its own target ISA: everything here has internal linkage).
//
// Two paths share the packed layout and the scale handling (fp8_linear.h):
//  * decode (small M): each thread streams whole 64- (or 32-) column blocks; the weights are
//    converted in registers right after the load and used by up to 4 rows at once.
//  * tiled (large M): a K block x 32/64 columns is converted once into a per-thread bf16
//    buffer (VNNI layout), then every row of an M chunk of up to 256 rows reads it: register
//    blocks of MR rows x NV vectors on AVX512-BF16, or 32- / 16-row x 32-column blocks on
//    AMX tiles (the last rows zero-padded to 16).
#pragma once

#include <ATen/Parallel.h>
#include "check.h"
#include <immintrin.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "fp8_linear.h"

namespace kb_cpu_amx {
namespace {

// ---- tuning table (data, near the kernels) -------------------------------------------------
// Decode: rows per pass over the weights (MR x 4 vectors accumulators, + 4 VBMI tables).
constexpr int kDecodeMaxRows = 4;
// Tiled: register block rows per vector count NV (MR * NV accumulators <= 24 of 32 zmm).
constexpr int kTiledRows4 = 6;   // NV = 4 (64 columns)
constexpr int kTiledRows2 = 12;  // NV = 2 (32 columns)
// Tiled: rows whose fp32 partial sums one work item keeps (kTiledChunkM x 64 x 4 bytes).
constexpr int64_t kTiledChunkM = 256;

// ---- E4M3 -> bf16 ---------------------------------------------------------------------------
// bf16 bits of the E4M3 magnitude code c (sign dropped). Normal codes (e = c >> 3 > 0):
// exponent e + 120, mantissa m << 4. Subnormals m * 2^-9 are normalised. 0x7F is NaN.
constexpr uint16_t e4m3_magnitude_bf16(int c) {
  const int e = c >> 3, m = c & 7;
  if (c == 0x7F) return 0x7FC0;
  if (e != 0) return static_cast<uint16_t>(((e + 120) << 7) | (m << 4));
  if (m == 0) return 0;
  const int q = m >= 4 ? 2 : (m >= 2 ? 1 : 0);  // m = 1.f * 2^q
  const int frac = (m << (3 - q)) & 7;
  return static_cast<uint16_t>(((q - 9 + 127) << 7) | (frac << 4));
}

struct MagnitudeTables {
  alignas(64) uint8_t lo[128];   // low byte of the bf16 of each magnitude code
  alignas(64) uint8_t hi[128];   // high byte
  alignas(64) uint16_t sub[32];  // bf16 of codes 0..7 (subnormals), index 31: NaN
  constexpr MagnitudeTables() : lo(), hi(), sub() {
    for (int c = 0; c < 128; ++c) {
      lo[c] = static_cast<uint8_t>(e4m3_magnitude_bf16(c) & 0xFF);
      hi[c] = static_cast<uint8_t>(e4m3_magnitude_bf16(c) >> 8);
    }
    for (int c = 0; c < 8; ++c) sub[c] = e4m3_magnitude_bf16(c);
    sub[31] = e4m3_magnitude_bf16(0x7F);
  }
};
constexpr MagnitudeTables kTables{};

// Integer formula + LUT for the exponent-0 codes: per 32 weights, a handful of ALU ops and one
// in-lane vpermw. Input: 32 codes zero-extended to 16 bits.
struct ConvInt {
  static constexpr int kElemBytes = 1;
  __m512i sub_lut;
  ConvInt() : sub_lut(_mm512_load_si512(reinterpret_cast<const void*>(kTables.sub))) {}

  inline __m512i one(__m512i w) const {
    __m512i t = _mm512_and_si512(_mm512_slli_epi16(w, 4), _mm512_set1_epi16(0x07F0));
    t = _mm512_add_epi16(t, _mm512_set1_epi16(0x3C00));
    const __mmask32 sub = _mm512_testn_epi16_mask(w, _mm512_set1_epi16(0x78));
    // The formula maps the NaN codes to 0x43F0 (480.0): send them to the LUT's NaN too.
    const __mmask32 nan = _mm512_cmpeq_epi16_mask(t, _mm512_set1_epi16(0x43F0));
    t = _mm512_mask_permutexvar_epi16(t, _kor_mask32(sub, nan), w, sub_lut);
    // t | (w << 8 & 0x8000): ternary-logic truth table A | (B & C) = 0xF8.
    return _mm512_ternarylogic_epi32(t, _mm512_slli_epi16(w, 8),
                                     _mm512_set1_epi16(static_cast<int16_t>(0x8000)), 0xF8);
  }
  // 64 packed bytes (one tile, one pair) -> vector 0 and vector 1 as bf16.
  inline void pair(const uint8_t* p, __m512i& v0, __m512i& v1) const {
    const __m512i b = _mm512_loadu_si512(reinterpret_cast<const void*>(p));
    v0 = one(_mm512_unpacklo_epi8(b, _mm512_setzero_si512()));
    v1 = one(_mm512_unpackhi_epi8(b, _mm512_setzero_si512()));
  }
};

#if defined(KB_ENABLE_VBMI)
// Two 128-entry byte tables (low and high byte of the bf16), indexed by the code's low 7 bits
// (vpermi2b ignores bit 7); the sign bit is OR-ed into the high byte; the byte unpacks build
// the bf16 words. Five instructions per 64 weights.
struct ConvVbmi {
  static constexpr int kElemBytes = 1;
  __m512i lo0, lo1, hi0, hi1;
  ConvVbmi()
      : lo0(_mm512_load_si512(reinterpret_cast<const void*>(kTables.lo))),
        lo1(_mm512_load_si512(reinterpret_cast<const void*>(kTables.lo + 64))),
        hi0(_mm512_load_si512(reinterpret_cast<const void*>(kTables.hi))),
        hi1(_mm512_load_si512(reinterpret_cast<const void*>(kTables.hi + 64))) {}

  inline void pair(const uint8_t* p, __m512i& v0, __m512i& v1) const {
    const __m512i b = _mm512_loadu_si512(reinterpret_cast<const void*>(p));
    const __m512i lo = _mm512_permutex2var_epi8(lo0, b, lo1);
    __m512i hi = _mm512_permutex2var_epi8(hi0, b, hi1);
    hi = _mm512_ternarylogic_epi32(hi, b, _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);
    v0 = _mm512_unpacklo_epi8(lo, hi);
    v1 = _mm512_unpackhi_epi8(lo, hi);
  }
};
#endif

// bf16 weights: already in the operand layout.
struct LoadBf16 {
  static constexpr int kElemBytes = 2;
  inline void pair(const uint8_t* p, __m512i& v0, __m512i& v1) const {
    v0 = _mm512_loadu_si512(reinterpret_cast<const void*>(p));
    v1 = _mm512_loadu_si512(reinterpret_cast<const void*>(p + 64));
  }
};

// ---- small helpers --------------------------------------------------------------------------
template <class Conv>
inline const uint8_t* pair_ptr(const LinearArgs& a, int64_t t, int64_t p) {
  return static_cast<const uint8_t*>(a.w) + (t * (a.K / 2) + p) * 64 * Conv::kElemBytes;
}

inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }

// The 32-bit pair x[k], x[k+1] broadcast to all lanes.
inline __m512bh bcast_pair(const uint16_t* x) {
  int32_t v;
  std::memcpy(&v, x, sizeof(v));
  return as_bh(_mm512_set1_epi32(v));
}

// Scales of the 16 columns starting at col, from the scale row of one K block.
inline __m512 load_scale(const float* srow, int64_t col, int64_t group_n) {
  if (group_n == 1) return _mm512_loadu_ps(srow + col);
  return _mm512_set1_ps(srow[col / group_n]);
}

// Store 16 fp32 results (+ bias) at out[row, col].
inline void store16(const LinearArgs& a, int64_t row, int64_t col, __m512 v) {
  if (a.bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(a.bias + col));
  if (a.out_fp32) {
    _mm512_storeu_ps(static_cast<float*>(a.out) + row * a.ldo + col, v);
  } else {
    const __m256bh h = _mm512_cvtneps_pbh(v);  // round to nearest even
    _mm256_storeu_si256(
        reinterpret_cast<__m256i*>(static_cast<uint16_t*>(a.out) + row * a.ldo + col),
        (__m256i)h);
  }
}

struct AlignedFree {
  void operator()(void* p) const { std::free(p); }
};
template <typename T>
std::unique_ptr<T[], AlignedFree> aligned_buffer(int64_t count) {
  const size_t bytes = ((static_cast<size_t>(count) * sizeof(T) + 63) / 64) * 64;
  void* p = std::aligned_alloc(64, bytes);
  KB_CHECK(p != nullptr, "kernelbay-cpu-amx: cannot allocate ", bytes, " bytes");
  return std::unique_ptr<T[], AlignedFree>(static_cast<T*>(p));
}

// ---- decode: MR rows x NV vectors (16 columns each), whole K --------------------------------
// Each K block sums into MR x NV accumulator chains (two sets, even/odd pairs, when that is
// fewer than 12, to keep enough dot products in flight to hide their latency); the block's
// sum is scaled once into `total`, kept in L1 to leave the registers to the chains.
template <int MR, int NV, class Conv>
void decode_block(const LinearArgs& a, const Conv& cv, int64_t col0, int64_t m0) {
  constexpr int U = MR * NV < 12 ? 2 : 1;
  const int64_t pairs = a.bk / 2;
  const int64_t nkb = a.K / a.bk;
  const int64_t t0 = col0 / 32;
  alignas(64) float total[MR * NV * 16] = {};
  for (int64_t kb = 0; kb < nkb; ++kb) {
    __m512 acc[U][MR][NV];
#pragma GCC unroll 2
    for (int u = 0; u < U; ++u)
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) acc[u][m][v] = _mm512_setzero_ps();
    const int64_t p0 = kb * pairs;
    const uint16_t* xp = a.x + m0 * a.ldx + 2 * p0;
    const uint8_t* wp[NV / 2];
#pragma GCC unroll 2
    for (int tt = 0; tt < NV / 2; ++tt) wp[tt] = pair_ptr<Conv>(a, t0 + tt, p0);
    for (int64_t p = 0; p < pairs; p += U) {
#pragma GCC unroll 2
      for (int u = 0; u < U; ++u) {
        __m512i w[NV];
#pragma GCC unroll 2
        for (int tt = 0; tt < NV / 2; ++tt) {
          cv.pair(wp[tt] + (p + u) * 64 * Conv::kElemBytes, w[2 * tt], w[2 * tt + 1]);
        }
#pragma GCC unroll 4
        for (int m = 0; m < MR; ++m) {
          const __m512bh xa = bcast_pair(xp + m * a.ldx + 2 * (p + u));
#pragma GCC unroll 4
          for (int v = 0; v < NV; ++v) {
            acc[u][m][v] = _mm512_dpbf16_ps(acc[u][m][v], xa, as_bh(w[v]));
          }
        }
      }
    }
    const float* srow = a.scale + kb * a.scale_kb_stride;
    __m512 s[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) s[v] = load_scale(srow, col0 + 16 * v, a.group_n);
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        __m512 sum = acc[0][m][v];
        if constexpr (U == 2) sum = _mm512_add_ps(sum, acc[1][m][v]);
        float* tp = total + (m * NV + v) * 16;
        _mm512_store_ps(tp, _mm512_fmadd_ps(sum, s[v], _mm512_load_ps(tp)));
      }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) {
      store16(a, m0 + m, col0 + 16 * v, _mm512_load_ps(total + (m * NV + v) * 16));
    }
}

template <int NV, class Conv>
void decode(const LinearArgs& a) {
  constexpr int64_t cols = NV * 16;
  // Column blocks are independent: split them over torch's intra-op threads.
  at::parallel_for(0, a.N / cols, 1, [&](int64_t begin, int64_t end) {
    const Conv cv;
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t m0 = 0; m0 < a.M; m0 += kDecodeMaxRows) {
        switch (std::min<int64_t>(kDecodeMaxRows, a.M - m0)) {
          case 1: decode_block<1, NV>(a, cv, b * cols, m0); break;
          case 2: decode_block<2, NV>(a, cv, b * cols, m0); break;
          case 3: decode_block<3, NV>(a, cv, b * cols, m0); break;
          default: decode_block<4, NV>(a, cv, b * cols, m0); break;
        }
      }
    }
  });
}

// ---- tiled: convert K block x (NV * 16) columns once, reuse it for every row ----------------
// Buffer layout: [pair][NV vectors][16 columns][2 k] bf16, the VNNI layout of dpbf16 and of an
// AMX B tile (row = pair, row stride NV * 64 bytes).
template <int NV, class Conv>
void convert_block(const LinearArgs& a, const Conv& cv, int64_t t0, int64_t p0, int64_t pairs,
                   uint16_t* buf) {
#pragma GCC unroll 2
  for (int tt = 0; tt < NV / 2; ++tt) {
    const uint8_t* wp = pair_ptr<Conv>(a, t0 + tt, p0);
    for (int64_t p = 0; p < pairs; ++p) {
      __m512i w0, w1;
      cv.pair(wp + p * 64 * Conv::kElemBytes, w0, w1);
      _mm512_store_si512(reinterpret_cast<void*>(buf + (p * NV + 2 * tt) * 32), w0);
      _mm512_store_si512(reinterpret_cast<void*>(buf + (p * NV + 2 * tt + 1) * 32), w1);
    }
  }
}

// c[MR rows][NV * 16] (row stride ldc, fp32) += s * (x[MR rows, 2 * pairs] . buf).
template <int MR, int NV>
void micro(const uint16_t* x, int64_t ldx, const uint16_t* buf, int64_t pairs, float* c,
           int64_t ldc, const __m512* s) {
  __m512 acc[MR][NV];
#pragma GCC unroll 12
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh w[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      w[v] = as_bh(_mm512_load_si512(reinterpret_cast<const void*>(buf + (p * NV + v) * 32)));
    }
#pragma GCC unroll 12
    for (int m = 0; m < MR; ++m) {
      const __m512bh xa = bcast_pair(x + m * ldx + 2 * p);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], xa, w[v]);
    }
  }
#pragma GCC unroll 12
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      float* cp = c + m * ldc + v * 16;
      _mm512_storeu_ps(cp, _mm512_fmadd_ps(acc[m][v], s[v], _mm512_loadu_ps(cp)));
    }
}

template <int NV, int MR = (NV == 4 ? kTiledRows4 : kTiledRows2)>
void micro_rows(int64_t rows, const uint16_t* x, int64_t ldx, const uint16_t* buf, int64_t pairs,
                float* c, int64_t ldc, const __m512* s) {
  if constexpr (MR == 1) {
    micro<1, NV>(x, ldx, buf, pairs, c, ldc, s);
  } else {
    if (rows >= MR) return micro<MR, NV>(x, ldx, buf, pairs, c, ldc, s);
    return micro_rows<NV, MR - 1>(rows, x, ldx, buf, pairs, c, ldc, s);
  }
}

template <int NV, class Conv>
void tiled(const LinearArgs& a, bool use_amx) {
  constexpr int64_t cols = NV * 16;
  constexpr int MR = NV == 4 ? kTiledRows4 : kTiledRows2;
  const int64_t supers = a.N / cols;
  const int64_t mchunks = (a.M + kTiledChunkM - 1) / kTiledChunkM;
  const int64_t pairs = a.bk / 2;
  const int64_t nkb = a.K / a.bk;
  at::parallel_for(0, supers * mchunks, 1, [&](int64_t begin, int64_t end) {
    const Conv cv;
    auto buf = aligned_buffer<uint16_t>(pairs * cols * 2);
    auto acc = aligned_buffer<float>(std::min(kTiledChunkM, a.M) * cols);
    alignas(64) float amx_c[32 * 32];
    auto pad = aligned_buffer<uint16_t>(use_amx ? 16 * a.bk : 1);  // AMX: the last < 16 rows
    if (use_amx) tile_config_amx();
    for (int64_t item = begin; item < end; ++item) {
      const int64_t st = item / mchunks;
      const int64_t mc0 = (item % mchunks) * kTiledChunkM;
      const int64_t rows = std::min<int64_t>(kTiledChunkM, a.M - mc0);
      const int64_t col0 = st * cols;
      std::fill(acc.get(), acc.get() + rows * cols, 0.0f);
      for (int64_t kb = 0; kb < nkb; ++kb) {
        convert_block<NV>(a, cv, st * (NV / 2), kb * pairs, pairs, buf.get());
        const float* srow = a.scale + kb * a.scale_kb_stride;
        __m512 s[NV];
        for (int v = 0; v < NV; ++v) s[v] = load_scale(srow, col0 + v * 16, a.group_n);
        const uint16_t* xk = a.x + mc0 * a.ldx + kb * a.bk;
        int64_t m = 0;
        if (use_amx) {
          // Every row on AMX tiles: 32-row blocks, then a 16-row block, then the last rows
          // copied into a zero-padded 16-row block; 32 columns (two vectors) per pass.
          while (m < rows) {
            const int64_t left = rows - m;
            const int row_tiles = left >= 32 ? 2 : 1;
            const int64_t take = std::min<int64_t>(left, 16 * row_tiles);
            const uint16_t* xa = xk + m * a.ldx;
            int64_t lda = a.ldx;
            if (take < 16) {
              std::fill(pad.get(), pad.get() + 16 * a.bk, uint16_t{0});
              for (int64_t r = 0; r < take; ++r) {
                std::memcpy(pad.get() + r * a.bk, xa + r * a.ldx, a.bk * sizeof(uint16_t));
              }
              xa = pad.get();
              lda = a.bk;
            }
            for (int vp = 0; vp < NV / 2; ++vp) {
              amx_block(xa, lda, row_tiles, buf.get() + vp * 64, NV * 64, a.bk / 32,
                        amx_c);
              for (int64_t r = 0; r < take; ++r) {
                for (int h = 0; h < 2; ++h) {
                  float* cp = acc.get() + (m + r) * cols + (2 * vp + h) * 16;
                  const __m512 cv16 = _mm512_load_ps(amx_c + r * 32 + h * 16);
                  _mm512_storeu_ps(cp,
                                   _mm512_fmadd_ps(cv16, s[2 * vp + h], _mm512_loadu_ps(cp)));
                }
              }
            }
            m += take;
          }
        }
        for (; m < rows; m += MR) {
          micro_rows<NV>(std::min<int64_t>(MR, rows - m), xk + m * a.ldx, a.ldx, buf.get(),
                         pairs, acc.get() + m * cols, cols, s);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        for (int v = 0; v < NV; ++v) {
          store16(a, mc0 + r, col0 + v * 16, _mm512_loadu_ps(acc.get() + r * cols + v * 16));
        }
      }
    }
    if (use_amx) tile_release_amx();
  });
}

template <class Conv>
void run(const LinearArgs& a, Path path, bool use_amx) {
  KB_CHECK(!use_amx || amx_compiled(),
           "kernelbay-cpu-amx: AMX requested but this build has no AMX code");
  if (path == Path::kDecode) {
    a.N % 64 == 0 ? decode<4, Conv>(a) : decode<2, Conv>(a);
  } else if (a.N % 64 == 0) {
    tiled<4, Conv>(a, use_amx);
  } else {
    tiled<2, Conv>(a, use_amx);
  }
}

}  // namespace
}  // namespace kb_cpu_amx
