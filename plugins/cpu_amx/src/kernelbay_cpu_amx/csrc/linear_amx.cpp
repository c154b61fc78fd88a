// AMX (amx_tile + amx_bf16) block for the tiled path, and the runtime permission request.
//
// Built with -mamx-tile -mamx-bf16 when the compiler supports them (the macros below); the
// code only runs after amx_request_permission() returned true, which needs the CPU to report
// AMX (CPUID.7.0:EDX bits 22 and 24) and the kernel to grant XTILEDATA to this process.
//
// Tile use for one 32 x 32 block of C, per k step of 32 (16 pairs):
//   tmm4, tmm5: A rows 0-15 and 16-31 (16 rows x 32 bf16), tmm6, tmm7: B vectors 0 and 1
//   (16 pairs x 16 columns x 2), tmm0..3: C quarters (16 x 16 fp32), C[i][j] += A_i . B_j.
// A 16 x 32 block uses tmm4, tmm6, tmm7 and C quarters tmm0, tmm1 only.
#include "check.h"
#include <immintrin.h>

#include <cstdint>

#include "fp8_linear.h"

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define KB_HAVE_AMX 1
#include <cpuid.h>
#else
#define KB_HAVE_AMX 0
#endif

namespace kb_cpu_amx {

#if KB_HAVE_AMX

namespace {
constexpr int kArchReqXcompPerm = 0x1023;  // arch_prctl: request an XSAVE feature
constexpr int kXfeatureXtiledata = 18;

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

bool cpu_reports_amx() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool amx_bf16 = (edx >> 22) & 1U;
  const bool amx_tile = (edx >> 24) & 1U;
  return amx_bf16 && amx_tile;
}
}  // namespace

bool amx_compiled() { return true; }

bool amx_request_permission() {
  static const bool granted = [] {
    if (!cpu_reports_amx()) return false;
#if defined(__linux__)
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
    return false;
#endif
  }();
  return granted;
}

void tile_config_amx() {
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int i = 0; i < 8; ++i) {
    cfg.rows[i] = 16;
    cfg.colsb[i] = 64;
  }
  _tile_loadconfig(&cfg);
}

void tile_release_amx() { _tile_release(); }

void amx_block(const uint16_t* x, int64_t ldx, int row_tiles, const uint16_t* b,
               int64_t b_stride_bytes, int64_t ksteps, float* c) {
  const int64_t x_stride = ldx * 2;
  const int64_t b_step = 16 * b_stride_bytes / 2;  // 16 pairs, in bf16 elements
  _tile_zero(0);
  _tile_zero(1);
  if (row_tiles == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t ks = 0; ks < ksteps; ++ks) {
    const uint16_t* xa = x + ks * 32;
    const uint16_t* bb = b + ks * b_step;
    _tile_loadd(4, xa, x_stride);
    _tile_loadd(6, bb, b_stride_bytes);
    _tile_loadd(7, bb + 32, b_stride_bytes);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (row_tiles == 2) {
      _tile_loadd(5, xa + 16 * ldx, x_stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, 128);
  _tile_stored(1, c + 16, 128);
  if (row_tiles == 2) {
    _tile_stored(2, c + 16 * 32, 128);
    _tile_stored(3, c + 16 * 32 + 16, 128);
  }
}

#else  // no AMX support in this compiler: the tiled path keeps to AVX512-BF16.

bool amx_compiled() { return false; }
bool amx_request_permission() { return false; }
void tile_config_amx() { KB_CHECK(false, "kernelbay-cpu-amx: built without AMX"); }
void tile_release_amx() {}
void amx_block(const uint16_t*, int64_t, int, const uint16_t*, int64_t, int64_t, float*) {
  KB_CHECK(false, "kernelbay-cpu-amx: built without AMX");
}

#endif

}  // namespace kb_cpu_amx
