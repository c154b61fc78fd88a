"""``nvfp4-emulation``: NVFP4 weights dequantized by the one reference, then ``F.linear``.

Math (``kernelbay.formats`` does every step):

    W = e2m1(code[n, k]) * (float(weight_scale[n, k // 16]) * weight_scale_2)   fp32, once
    weight-only (activation None):    y = F.linear(x, W.to(x.dtype), b)
    W4A4 (activation nvfp4-dynamic):  what an FP4 tensor-core kernel computes with the
        checkpoint's static ``input_scale`` as the activation's global scale and E4M3 block
        scales per 16 taken from the tokens on the fly (FORMATS.md):
        xq = dequantize_nvfp4(*quantize_nvfp4(x, input_scale))          fp32
        y  = F.linear(xq, W, b.float()).to(x.dtype)                       in fp32

This is the correctness baseline and the fallback on any device; Triton kernels come later.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar, cast

from kernelbay.layers.linear import LinearMethod, TensorSpec
from kernelbay.requests import LinearRequest
from kernelbay.verdict import Verdict

from kernelbay_quant_nvfp4.schemes import (
    FLOAT_DTYPES,
    NVFP4_BLOCK,
    W4A4_ACTIVATION,
    dense_only,
    k_in_blocks,
    nvfp4_layer_checks,
)
from kernelbay_quant_nvfp4.tp import block_scale_sharding

if TYPE_CHECKING:
    import torch
    from kernelbay.device import DeviceCapability

__all__ = ["DEQUANTIZED_WEIGHT", "W4A4_ACTIVATION", "Nvfp4EmulationLinear",
           "fake_quantize_nvfp4"]

#: Name of the buffer holding the dequantized weight after loading.
DEQUANTIZED_WEIGHT = "dequantized_weight"
#: The activation quantization of W4A4 NVFP4 schemes (the only one emulated).


def fake_quantize_nvfp4(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """``x [..., K]`` quantized to NVFP4 with the static global scale ``input_scale`` and read
    back, in float32 (``kernelbay.formats``): what a W4A4 kernel multiplies."""
    import torch
    from kernelbay.formats import dequantize_nvfp4, quantize_nvfp4

    if x.numel() == 0:
        return x.to(torch.float32)
    packed, scales, g = quantize_nvfp4(x, input_scale)
    return dequantize_nvfp4(packed, scales, g)


class Nvfp4EmulationLinear(LinearMethod):
    """Reference NVFP4 linear on any device: dequantize the weight once through
    ``kernelbay.formats`` after loading, then ``torch.nn.functional.linear``."""

    name: ClassVar[str] = "nvfp4-emulation"
    api_version: ClassVar[str] = "1.0"
    priority: ClassVar[int] = 10
    summary: ClassVar[str] = "NVFP4 weights dequantized by the reference, then F.linear; any device"

    @classmethod
    def can_implement(cls, request: LinearRequest, device: DeviceCapability) -> Verdict:
        del device  # plain torch: runs wherever torch does
        s = request.scheme
        verdict = Verdict.all(
            dense_only(request),
            nvfp4_layer_checks(s, "weights",
                               f"emulates activations None or {W4A4_ACTIVATION!r}"),
            Verdict.check(request.activation_dtype in FLOAT_DTYPES,
                          f"needs activation dtype in {FLOAT_DTYPES}, request has "
                          f"{request.activation_dtype!r}"),
            k_in_blocks(request),
        )
        if verdict.accepted and s.activation is not None:
            return Verdict.accept(f"activations fake-quantized {s.activation} with the static "
                                  "input_scale, matmul in float32")
        return verdict

    @property
    def w4a4(self) -> bool:
        """Whether activations are quantized (the scheme carries ``nvfp4-dynamic``)."""
        return self.request.scheme.activation == W4A4_ACTIVATION

    def tensor_specs(self) -> Mapping[str, TensorSpec]:
        r = self.request
        n, k = r.out_features, r.in_features
        weight_dim = self.weight_shard_dim
        # Block scales follow the weight: one scale row per weight row (block 1 along N),
        # one scale per 16 weight columns along K.
        scale_shape: tuple[int, ...] = (n, k // NVFP4_BLOCK)
        scale_dim = weight_dim
        if r.parallel == "row" and block_scale_sharding(k * r.tp_size, r.tp_size,
                                                        NVFP4_BLOCK) == "replicate":
            scale_shape, scale_dim = (n, -(-k * r.tp_size // NVFP4_BLOCK)), None
        specs = {
            "weight": TensorSpec((n, k // 2), "uint8", weight_dim),
            "weight_scale": TensorSpec(scale_shape, "float8_e4m3fn", scale_dim),
            # Per-tensor (per fused shard) scalars: every rank holds the same value.
            "weight_scale_2": TensorSpec((), "float32", None),
        }
        if self.w4a4:
            # The static activation scale a W4A4 kernel needs; weight-only checkpoints have none.
            specs["input_scale"] = TensorSpec((), "float32", None)
        return {**specs, **self.bias_specs()}

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Dequantize once through ``kernelbay.formats.dequantize_nvfp4`` and cache the
        weight as the buffer ``dequantized_weight``: float32 for W4A4 (the matmul runs in
        float32), else in the activation dtype."""
        import torch
        from kernelbay.formats import dequantize_nvfp4

        params = {n: p.data for n, p in layer.named_parameters(recurse=False)}
        weight = dequantize_nvfp4(params["weight"], params["weight_scale"],
                                  params["weight_scale_2"])
        dtype = torch.float32 if self.w4a4 else getattr(torch, self.request.activation_dtype)
        layer.register_buffer(DEQUANTIZED_WEIGHT, weight.to(dtype), persistent=False)

    def _weight(self, layer: torch.nn.Module) -> torch.Tensor:
        weight: torch.Tensor | None = getattr(layer, DEQUANTIZED_WEIGHT, None)
        if weight is None:
            raise RuntimeError(f"{self.name}: call process_weights_after_loading(layer) before "
                               "apply; the dequantized weight is made there")
        return weight

    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F

        weight = self._weight(layer)
        bias = self.rank_bias(layer)
        if not self.w4a4:
            return F.linear(x, weight, bias)
        xq = fake_quantize_nvfp4(x, cast("torch.Tensor", layer.input_scale))
        out = F.linear(xq, weight, None if bias is None else bias.float())
        return out.to(x.dtype)

    def dequantized_weight(self, layer: torch.nn.Module) -> torch.Tensor:
        """The cached dequantized weight in the activation dtype (exact; MLA absorbs it)."""
        import torch

        return self._weight(layer).to(getattr(torch, self.request.activation_dtype))
