"""The always-available FP8 reference linear: dequantize through ``kernelbay.formats``, then matmul.

Serves the shared FP8 schemes: ``fp8`` (one fp32 scale per tensor) and ``fp8-block`` (one
fp32 scale per ``group_shape`` tile of [N, K]). Weight-only: activations stay in their dtype.
Plugins offer faster kernels for the same schemes; every one is tested against this.
"""

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

__all__ = ["TorchFp8DequantLinear", "fp8_block_shape"]

_SCHEMES = ("fp8", "fp8-block")
_FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def fp8_block_shape(request: LinearRequest) -> tuple[int, int] | None:
    """The (rows, cols) scale tile of an ``fp8-block`` request (``None`` for per-tensor)."""
    if request.scheme.name != "fp8-block":
        return None
    return request.scheme.group_shape or (128, 128)


class TorchFp8DequantLinear(LinearMethod):
    """FP8 E4M3 weights with fp32 scales, dequantized once after loading, then F.linear."""

    name: ClassVar[str] = "torch-fp8-dequant"
    api_version: ClassVar[str] = PLUGIN_API_VERSION
    priority: ClassVar[int] = 0
    summary: ClassVar[str] = "FP8 per-tensor / per-block weights, dequantize then matmul, any device"

    @classmethod
    def can_implement(cls, request: LinearRequest, device: DeviceCapability) -> Verdict:
        block = fp8_block_shape(request)
        return Verdict.all(
            Verdict.handles(request.scheme.name in _SCHEMES,
                          f"handles schemes {_SCHEMES}, layer is {request.scheme.name!r}"),
            Verdict.handles(request.num_experts is None,
                            f"handles dense layers only, request stacks {request.num_experts} "
                            "routed experts"),
            Verdict.check(request.activation_dtype in _FLOAT_DTYPES,
                          f"needs activation dtype in {_FLOAT_DTYPES}, request has "
                          f"{request.activation_dtype!r}"),
            Verdict.check(block is None or min(block) > 0,
                          f"needs a positive scale block, scheme has {block}"),
        )

    def tensor_specs(self) -> Mapping[str, TensorSpec]:
        r = self.request
        n, k = r.out_features, r.in_features
        shard = self.weight_shard_dim
        block = fp8_block_shape(r)
        scale_shape: tuple[int, ...] = (() if block is None
                                        else (-(-n // block[0]), -(-k // block[1])))
        specs = {
            "weight": TensorSpec((n, k), "float8_e4m3fn", shard),
            "weight_scale": TensorSpec(scale_shape, "float32", None if block is None else shard),
            **self.bias_specs(),
        }
        if block is None:
            # Static-activation exports carry an input scale; weight-only math ignores it.
            specs["input_scale"] = TensorSpec((), "float32", None, required=False)
        return specs

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        import torch

        from kernelbay.formats.fp8 import dequantize_fp8_per_block, dequantize_fp8_per_tensor

        dtype = getattr(torch, self.request.activation_dtype)
        weight = cast("torch.Tensor", layer.weight)
        scale = cast("torch.Tensor", layer.weight_scale)
        block = fp8_block_shape(self.request)
        if block is None:
            dense = dequantize_fp8_per_tensor(weight, scale, dtype)
        else:
            dense = dequantize_fp8_per_block(weight, scale, block, dtype)
        layer.dense_weight = torch.nn.Parameter(dense, requires_grad=False)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F

        return F.linear(x, cast("torch.Tensor", layer.dense_weight), self.rank_bias(layer))

    def dequantized_weight(self, layer: torch.nn.Module) -> torch.Tensor:
        return cast("torch.Tensor", layer.dense_weight)
