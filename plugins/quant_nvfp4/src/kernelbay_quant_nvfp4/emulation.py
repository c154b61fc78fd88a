"""``nvfp4-emulation``: NVFP4 weights dequantized by the one reference, then ``F.linear``.

Math: ``W[n, k] = e2m1(code[n, k]) * (float(weight_scale[n, k // 16]) * weight_scale_2)``
(``kernelbay.formats.dequantize_nvfp4``, in float32), cast once to the activation dtype after
loading and cached; ``apply`` is ``F.linear(x, W, bias)``. Activations are not quantized, so
``input_scale`` (a W4A4 kernel's static activation scale) is read when present and unused.
This is the correctness baseline and the fallback on any device; Triton kernels come later.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar

from kernelbay.layers.linear import LinearMethod, TensorSpec
from kernelbay.requests import LinearRequest
from kernelbay.verdict import Verdict

from kernelbay_quant_nvfp4.schemes import FLOAT_DTYPES, NVFP4_BLOCK
from kernelbay_quant_nvfp4.tp import block_scale_sharding

if TYPE_CHECKING:
    import torch
    from kernelbay.device import DeviceCapability

__all__ = ["DEQUANTIZED_WEIGHT", "Nvfp4EmulationLinear"]

#: Name of the buffer holding the dequantized weight after loading.
DEQUANTIZED_WEIGHT = "dequantized_weight"


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
        k = request.in_features
        verdict = Verdict.all(
            Verdict.handles(s.name == "nvfp4",
                          f"handles NVFP4 weights only, layer is {s.describe()}"),
            Verdict.check(s.group_shape == (1, NVFP4_BLOCK) and s.scale_dtype == "float8_e4m3fn",
                          f"needs NVFP4 blocks of 1x{NVFP4_BLOCK} with float8_e4m3fn scales, "
                          f"scheme has group {s.group_shape} with {s.scale_dtype!r} scales"),
            Verdict.check(request.activation_dtype in FLOAT_DTYPES,
                          f"needs activation dtype in {FLOAT_DTYPES}, request has "
                          f"{request.activation_dtype!r}"),
            Verdict.check(request.num_experts is None,
                          f"handles dense layers only, request stacks {request.num_experts} "
                          "experts"),
            Verdict.check(k > 0 and k % NVFP4_BLOCK == 0,
                          f"K={k} is not a multiple of the NVFP4 block {NVFP4_BLOCK}"),
        )
        if verdict.accepted and s.activation is not None:
            return Verdict.accept(f"weight-only emulation: activations stay "
                                  f"{request.activation_dtype} ({s.activation} not applied)")
        return verdict

    def tensor_specs(self) -> Mapping[str, TensorSpec]:
        r = self.request
        n, k = r.out_features, r.in_features
        weight_dim = {"column": 0, "row": 1}.get(r.parallel)
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
            "input_scale": TensorSpec((), "float32", None, required=False),
        }
        if r.bias:
            specs["bias"] = TensorSpec((n,), r.activation_dtype,
                                       0 if r.parallel == "column" else None)
        return specs

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Dequantize once through ``kernelbay.formats.dequantize_nvfp4`` and cache the
        weight in the activation dtype as the buffer ``dequantized_weight``."""
        import torch
        from kernelbay.formats import dequantize_nvfp4

        params = {n: p.data for n, p in layer.named_parameters(recurse=False)}
        weight = dequantize_nvfp4(params["weight"], params["weight_scale"],
                                  params["weight_scale_2"])
        dtype = getattr(torch, self.request.activation_dtype)
        layer.register_buffer(DEQUANTIZED_WEIGHT, weight.to(dtype), persistent=False)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F

        weight = getattr(layer, DEQUANTIZED_WEIGHT, None)
        if weight is None:
            raise RuntimeError(f"{self.name}: call process_weights_after_loading(layer) before "
                               "apply; the dequantized weight is made there")
        bias = getattr(layer, "bias", None)
        # Row-parallel partial sums are all-reduced afterwards: add the bias on one rank only.
        if self.request.parallel == "row" and self.request.tp_rank != 0:
            bias = None
        return F.linear(x, weight, bias)
