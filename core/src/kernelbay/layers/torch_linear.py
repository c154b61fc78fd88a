"""The always-available unquantized linear method, in plain torch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar, cast

from kernelbay._version import PLUGIN_API_VERSION
from kernelbay.layers.linear import LinearMethod, TensorSpec
from kernelbay.requests import LinearRequest
from kernelbay.verdict import Verdict

if TYPE_CHECKING:
    import torch

    from kernelbay.device import DeviceCapability

__all__ = ["TorchUnquantizedLinear"]

_FLOAT_DTYPES = ("float32", "bfloat16", "float16")


class TorchUnquantizedLinear(LinearMethod):
    """``torch.nn.functional.linear`` on unquantized weights, on any device."""

    name: ClassVar[str] = "torch-unquantized"
    api_version: ClassVar[str] = PLUGIN_API_VERSION
    priority: ClassVar[int] = 0
    summary: ClassVar[str] = "unquantized weights, torch F.linear, any device"

    @classmethod
    def can_implement(cls, request: LinearRequest, device: DeviceCapability) -> Verdict:
        return Verdict.all(
            Verdict.handles(not request.scheme.is_quantized,
                          f"handles unquantized weights only, layer is "
                          f"{request.scheme.describe()}"),
            Verdict.handles(request.num_experts is None,
                            f"handles dense layers only, request stacks {request.num_experts} "
                            "routed experts"),
            Verdict.check(request.activation_dtype in _FLOAT_DTYPES,
                          f"needs activation dtype in {_FLOAT_DTYPES}, "
                          f"request has {request.activation_dtype!r}"),
        )

    def tensor_specs(self) -> Mapping[str, TensorSpec]:
        r = self.request
        return {"weight": TensorSpec((r.out_features, r.in_features), r.activation_dtype,
                                     self.weight_shard_dim), **self.bias_specs()}

    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F

        return F.linear(x, cast("torch.Tensor", layer.weight), self.rank_bias(layer))

    def dequantized_weight(self, layer: torch.nn.Module) -> torch.Tensor:
        return cast("torch.Tensor", layer.weight)
