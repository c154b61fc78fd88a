// Python bindings: shape checks, then the kernels of linear_avx512.cpp / linear_amx.cpp.
#include <torch/extension.h>

#include "check.h"
#include "fp8_linear.h"

namespace kb_cpu_amx {
namespace {

// y = x @ W^T (+ bias) for packed W (uint8 E4M3 or bf16, [N/32, K/2, 64]).
// scale: fp32 [num_k_blocks, groups] with unit column stride (any row stride, 0 included);
// group_n: output columns per scale column (1, or a multiple of 16). path: "decode" | "tiled".
bool vbmi_supported() { return __builtin_cpu_supports("avx512vbmi"); }

// conv: "auto" (VBMI tables when the CPU has them), "int" (integer formula) or "vbmi".
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scale,
                     int64_t group_n, const c10::optional<torch::Tensor>& bias,
                     bool out_fp32, const std::string& path, bool use_amx,
                     const std::string& conv) {
  KB_CHECK(x.device().is_cpu() && w.device().is_cpu(), "kernelbay-cpu-amx runs on CPU");
  KB_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
           "x must be a 2-D bfloat16 tensor with contiguous rows, got ", x.sizes(), " ",
           x.scalar_type());
  KB_CHECK(w.dim() == 3 && w.size(2) == 64 && w.is_contiguous(),
           "packed weight must be contiguous [N/32, K/2, 64], got ", w.sizes());
  KB_CHECK(w.scalar_type() == at::kByte || w.scalar_type() == at::kBFloat16,
           "packed weight dtype must be uint8 (E4M3 bits) or bfloat16, got ", w.scalar_type());
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0) * 32;
  KB_CHECK(w.size(1) * 2 == K, "x has K=", K, " but the packed weight has K=", w.size(1) * 2);
  KB_CHECK(scale.dim() == 2 && scale.scalar_type() == at::kFloat,
           "scale must be a 2-D float32 view [num_k_blocks, groups], got ", scale.sizes(), " ",
           scale.scalar_type());
  KB_CHECK(scale.size(1) == 1 || scale.stride(1) == 1, "scale columns must be contiguous");
  const int64_t nkb = scale.size(0);
  KB_CHECK(nkb > 0 && K % nkb == 0, "K=", K, " is not a multiple of num_k_blocks=", nkb);
  const int64_t bk = K / nkb;
  KB_CHECK(bk % 32 == 0, "K block ", bk, " (K=", K, " / ", nkb, " blocks) is not a multiple of 32");
  KB_CHECK(group_n == 1 || group_n % 16 == 0, "group_n=", group_n,
           " must be 1 or a multiple of 16");
  KB_CHECK((N + group_n - 1) / group_n <= scale.size(1), "scale has ", scale.size(1),
           " groups, N=", N, " with group_n=", group_n, " needs ", (N + group_n - 1) / group_n);
  if (bias.has_value()) {
    KB_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
             "bias must be contiguous float32 [", N, "], got ", bias->sizes(), " ",
             bias->scalar_type());
  }
  KB_CHECK(path == "decode" || path == "tiled", "path must be 'decode' or 'tiled', got '",
           path, "'");
  KB_CHECK(conv == "auto" || conv == "int" || conv == "vbmi",
           "conv must be 'auto', 'int' or 'vbmi', got '", conv, "'");
  KB_CHECK(conv != "vbmi" || vbmi_supported(), "conv='vbmi' but this CPU lacks avx512vbmi");
  KB_CHECK(!use_amx || amx_request_permission(),
           "AMX requested but the CPU or the OS does not grant it");
  auto out = torch::empty({M, N}, x.options().dtype(out_fp32 ? at::kFloat : at::kBFloat16));
  if (M == 0) return out;
  LinearArgs a{};
  a.x = reinterpret_cast<const uint16_t*>(x.data_ptr());
  a.ldx = x.stride(0);
  a.w = w.data_ptr();
  a.fp8 = w.scalar_type() == at::kByte;
  a.scale = scale.data_ptr<float>();
  a.scale_kb_stride = scale.stride(0);
  a.group_n = group_n;
  a.bias = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  a.out = out.data_ptr();
  a.ldo = N;
  a.out_fp32 = out_fp32;
  a.M = M;
  a.N = N;
  a.K = K;
  a.bk = bk;
  const Path p = path == "decode" ? Path::kDecode : Path::kTiled;
  const bool vbmi = a.fp8 && (conv == "vbmi" || (conv == "auto" && vbmi_supported()));
  if (vbmi) {
    linear_vbmi(a, p, use_amx);
  } else {
    linear_base(a, p, use_amx);
  }
  return out;
}

}  // namespace
}  // namespace kb_cpu_amx

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kernelbay-cpu-amx: FP8 (E4M3) W8A16 and bf16 linear kernels, AVX512-BF16 / AMX";
  m.def("linear", &kb_cpu_amx::linear, "y = x @ W^T (+ bias) with packed W", py::arg("x"),
        py::arg("w"), py::arg("scale"), py::arg("group_n"), py::arg("bias"),
        py::arg("out_fp32"), py::arg("path"), py::arg("use_amx"), py::arg("conv") = "auto");
  m.def("vbmi_supported", &kb_cpu_amx::vbmi_supported,
        "True when the CPU has avx512vbmi (the faster E4M3 conversion)");
  m.def("amx_compiled", &kb_cpu_amx::amx_compiled, "True when this build contains AMX code");
  m.def("amx_request_permission", &kb_cpu_amx::amx_request_permission,
        "True when the CPU reports AMX and the OS granted tile data to this process");
}
