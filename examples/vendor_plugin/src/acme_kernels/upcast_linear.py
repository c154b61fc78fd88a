"""A linear method for CPUs without native bf16 arithmetic: keep an fp32 copy of the weight.

On an x86 CPU without AVX512-BF16, a bf16 GEMM converts both operands on every call. This
method converts the weight once after loading and runs the GEMM in fp32, trading twice the
weight memory for speed; the output is rounded back to the activation dtype.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar, cast

from kernelbay import LinearRequest, Verdict
from kernelbay.layers import LinearMethod, TensorSpec

if TYPE_CHECKING:
    import torch
    from kernelbay import DeviceCapability


class Fp32UpcastLinear(LinearMethod):
    """Unquantized bf16/fp16 layers computed in fp32 on CPUs that lack AVX512-BF16."""

    name: ClassVar[str] = "acme-fp32-upcast"
    api_version: ClassVar[str] = "1.0"
    priority: ClassVar[int] = 20
    summary: ClassVar[str] = "bf16/fp16 weights upcast once to fp32, for CPUs without bf16 FMA"

    @classmethod
    def can_implement(cls, request: LinearRequest, device: DeviceCapability) -> Verdict:
        return Verdict.all(
            # What this backend is for: unquantized layers on CPUs without native bf16.
            Verdict.handles(device.platform == "cpu",
                            f"runs on cpu devices, device is {device.platform!r}"),
            Verdict.handles(not device.has("avx512_bf16"),
                            "this CPU has 'avx512_bf16', where native bf16 matmul is faster"),
            Verdict.handles(not request.scheme.is_quantized,
                            f"handles unquantized weights, layer is {request.scheme.describe()}"),
            Verdict.check(request.activation_dtype in ("bfloat16", "float16"),
                          f"needs bfloat16 or float16 activations, request has "
                          f"{request.activation_dtype!r}"),
        )

    def tensor_specs(self) -> Mapping[str, TensorSpec]:
        r = self.request
        return {"weight": TensorSpec((r.out_features, r.in_features), r.activation_dtype,
                                     self.weight_shard_dim), **self.bias_specs()}

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        import torch

        weight = cast("torch.Tensor", layer.weight)
        layer.weight_fp32 = torch.nn.Parameter(weight.detach().float(), requires_grad=False)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F

        bias = self.rank_bias(layer)
        weight = cast("torch.Tensor", layer.weight_fp32)
        y = F.linear(x.float(), weight, None if bias is None else bias.float())
        return y.to(x.dtype)
