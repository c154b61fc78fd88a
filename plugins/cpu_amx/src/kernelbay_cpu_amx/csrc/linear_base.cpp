// Kernels with the AVX512-BW integer E4M3 -> bf16 conversion (and bf16 weights): every
// AVX512-BF16 CPU runs these. Code: kernels_impl.h.
#include "kernels_impl.h"

namespace kb_cpu_amx {

void linear_base(const LinearArgs& a, Path path, bool use_amx) {
  if (a.fp8) {
    run<ConvInt>(a, path, use_amx);
  } else {
    run<LoadBf16>(a, path, use_amx);
  }
}

}  // namespace kb_cpu_amx
