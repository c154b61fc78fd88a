"""``mxfp4-emulation``: OCP MXFP4 weights (and MX activations) through the one reference.

Math, with ``kernelbay.formats.mx`` doing every step:

    W = dequantize_mx(weight, weight_scale, "e2m1")                    fp32 [N, K], once
    weight-only (activation None):   y = F.linear(x, W.to(x.dtype), b)
    W4A4 / W4A8 (mxfp4-dynamic / mxfp8-dynamic activations):
        xq = dequantize_mx(*quantize_mx(x, elem, rule), elem)         fp32, per 32 along K
        y  = F.linear(xq, W, b.float()).to(x.dtype)                    in fp32

``elem`` is ``e2m1`` for mxfp4-dynamic and ``e4m3`` for mxfp8-dynamic; ``rule`` is the
scheme's ``scale_mode`` option (Quark's ``scale_calculation_mode``; default ``even``), which
must be one of ``kernelbay.formats.mx``'s rules. This is the correctness baseline and the
fallback on any device; the Triton kernels for ROCm come next.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar

from kernelbay.layers.linear import LinearMethod, TensorSpec
from kernelbay.requests import LinearRequest, QuantScheme
from kernelbay.verdict import Verdict

from kernelbay_quant_mxfp4_rocm.devices import home_note

if TYPE_CHECKING:
    import torch
    from kernelbay.device import DeviceCapability

__all__ = ["DEQUANTIZED_WEIGHT", "MX_ACTIVATIONS", "SCALE_RULES", "Mxfp4EmulationLinear",
           "dense_mx_checks", "fake_quantize_mx", "mx_layer_checks"]

#: Name of the buffer holding the dequantized weight after loading.
DEQUANTIZED_WEIGHT = "dequantized_weight"
#: Activation quantizations emulated, and the MX element type of each.
MX_ACTIVATIONS: dict[str, str] = {"mxfp4-dynamic": "e2m1", "mxfp8-dynamic": "e4m3"}
#: Scale rules of ``kernelbay.formats.mx`` (``ScaleRule``), kept here so that deciding does
#: not import torch; a test checks they are the same.
SCALE_RULES: tuple[str, ...] = ("floor", "even", "rceil")
_BLOCK = 32
_FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def fake_quantize_mx(x: torch.Tensor, elem: str, rule: str) -> torch.Tensor:
    """``x [..., K]`` quantized to OCP MX (``elem`` e2m1 or e4m3, blocks of 32 along K, the
    scale ``rule``) and read back in float32, through ``kernelbay.formats.mx``."""
    import torch
    from kernelbay.formats import dequantize_mx, quantize_mx

    if x.numel() == 0:
        return x.to(torch.float32)
    data, scales = quantize_mx(x, elem, rule)  # type: ignore[arg-type]
    return dequantize_mx(data, scales, elem)  # type: ignore[arg-type]


def mx_layer_checks(scheme: QuantScheme, layers: str) -> Verdict:
    """What every MXFP4 method asks of a layer's scheme: MXFP4 at all (else not applicable:
    "handles OCP MXFP4 ``layers`` only"), 1x32 E8M0 blocks, activations None or dynamic MX with
    a scale rule of ``kernelbay.formats.mx``."""
    s = scheme
    rule = s.option("scale_mode", "even")
    return Verdict.all(
        Verdict.handles(s.name == "mxfp4",
                        f"handles OCP MXFP4 {layers} only, layer is {s.describe()}"),
        Verdict.check(s.group_shape == (1, _BLOCK) and s.scale_dtype == "e8m0",
                      f"needs MX blocks of 1x{_BLOCK} with e8m0 scales, scheme has group "
                      f"{s.group_shape} with {s.scale_dtype!r} scales"),
        Verdict.check(s.activation is None or s.activation in MX_ACTIVATIONS,
                      f"emulates activations None or {sorted(MX_ACTIVATIONS)}, scheme has "
                      f"{s.activation!r}"),
        Verdict.check(s.activation is None or rule in SCALE_RULES,
                      f"needs an MX scale rule in {list(SCALE_RULES)} for its activations, "
                      f"scheme has scale_mode {rule!r}"),
    )


def dense_mx_checks(request: LinearRequest) -> Verdict:
    """What every dense MXFP4 linear method of this plugin needs from the request: a dense
    layer, MXFP4 weights in 1x32 E8M0 blocks, activations None or dynamic MX with a scale
    rule of ``kernelbay.formats.mx``, float activations, K a multiple of 32."""
    k = request.in_features
    return Verdict.all(
        Verdict.handles(request.num_experts is None,
                        f"handles dense layers only, request is a routed-expert MLP of "
                        f"{request.num_experts} experts"),
        mx_layer_checks(request.scheme, "weights"),
        Verdict.check(request.activation_dtype in _FLOAT_DTYPES,
                      f"needs activation dtype in {_FLOAT_DTYPES}, request has "
                      f"{request.activation_dtype!r}"),
        Verdict.check(k > 0 and k % _BLOCK == 0,
                      f"K={k} is not a multiple of the MX block {_BLOCK}"),
    )


class Mxfp4EmulationLinear(LinearMethod):
    """Reference OCP MXFP4 linear on any device: weights dequantized once through
    ``kernelbay.formats.mx``; dynamic MX activations fake-quantized through the same reference
    with the config's scale rule; then ``torch.nn.functional.linear``."""

    name: ClassVar[str] = "mxfp4-emulation"
    api_version: ClassVar[str] = "1.0"
    priority: ClassVar[int] = 10
    summary: ClassVar[str] = "OCP MXFP4 (W4A16/W4A4/W4A8) through the reference, then F.linear"

    @classmethod
    def can_implement(cls, request: LinearRequest, device: DeviceCapability) -> Verdict:
        s = request.scheme
        rule = s.option("scale_mode", "even")
        verdict = dense_mx_checks(request)
        if not verdict.accepted:
            return verdict
        notes = [home_note(device)]
        if s.activation is not None:
            notes.append(f"activations fake-quantized {s.activation} (scale rule {rule})")
        return Verdict.accept(*notes)

    @property
    def _activation_elem(self) -> str | None:
        activation = self.request.scheme.activation
        return None if activation is None else MX_ACTIVATIONS[activation]

    def tensor_specs(self) -> Mapping[str, TensorSpec]:
        r = self.request
        n, k = r.out_features, r.in_features
        # One E8M0 scale row per weight row and one per 32 columns: the scales shard on the
        # weight's dim, and a shard is always whole blocks because K % 32 == 0 per rank.
        dim = self.weight_shard_dim
        return {
            "weight": TensorSpec((n, k // 2), "uint8", dim),
            "weight_scale": TensorSpec((n, k // _BLOCK), "uint8", dim),
            **self.bias_specs(),
        }

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Dequantize once through ``kernelbay.formats.dequantize_mx`` and cache the weight as
        the buffer ``dequantized_weight``: fp32 when activations are quantized (the matmul runs
        in fp32), else in the activation dtype."""
        import torch
        from kernelbay.formats import dequantize_mx

        params = {n: p.data for n, p in layer.named_parameters(recurse=False)}
        weight = dequantize_mx(params["weight"], params["weight_scale"], "e2m1")
        dtype = (torch.float32 if self._activation_elem is not None
                 else getattr(torch, self.request.activation_dtype))
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
        bias = self.rank_bias(layer)  # row-parallel partial sums: the bias on rank 0 only
        elem = self._activation_elem
        if elem is None:
            return F.linear(x, weight, bias)
        xq = fake_quantize_mx(x, elem, self.request.scheme.option("scale_mode", "even") or "even")
        out = F.linear(xq, weight, None if bias is None else bias.float())
        return out.to(x.dtype)

    def dequantized_weight(self, layer: torch.nn.Module) -> torch.Tensor:
        """The cached dequantized weight in the activation dtype (exact; MLA absorbs it)."""
        import torch

        return self._weight(layer).to(getattr(torch, self.request.activation_dtype))
