// Kernels with the AVX512-VBMI table conversion (vpermi2b). This file alone is compiled for
// avx512vbmi; the caller runs it only when the CPU reports that flag (Cooper Lake has
// AVX512-BF16 without VBMI). Code: kernels_impl.h (internal linkage, so this copy never mixes
// with linear_base.cpp's). Library headers come first, outside the VBMI region, so only this
// file's own functions get the extra ISA.
#include <ATen/Parallel.h>
#include "check.h"
#include <immintrin.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512vbmi"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx512vbmi")
#endif

#define KB_ENABLE_VBMI 1
#include "kernels_impl.h"

namespace kb_cpu_amx {

void linear_vbmi(const LinearArgs& a, Path path, bool use_amx) {
  KB_CHECK(a.fp8, "kernelbay-cpu-amx: the VBMI conversion is for E4M3 weights");
  run<ConvVbmi>(a, path, use_amx);
}

}  // namespace kb_cpu_amx

#if defined(__clang__)
#pragma clang attribute pop
#elif defined(__GNUC__)
#pragma GCC pop_options
#endif
