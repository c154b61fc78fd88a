"""``mxfp4-moe-emulation``: OCP MXFP4 routed experts through the one reference, then the
reference MoE math of ``kernelbay.layers.moe``.

Per expert ``e`` and projection ``p`` (gate, up, down) the checkpoint holds an MXFP4 linear
layer under ``experts.{e}.{p}_proj.*``: ``weight`` uint8 [N, K/2] (packed E2M1) and
``weight_scale`` uint8 [N, K/32] (E8M0 bytes). After loading, every projection is
dequantized once with ``kernelbay.formats.dequantize_mx``. For token t routed to expert e
with weight w::

    weight-only:      h = SiLU(x W_gate^T) * (x W_up^T);  y[t] += w * (h W_down^T)  x's dtype
    MX activations:   x_q = fq(x);  h = SiLU(x_q W_gate^T) * (x_q W_up^T)           fp32
                      y[t] += w * (fq(h) W_down^T)                                   fp32

``fq`` is dynamic OCP MX quantization of each token's blocks of 32 (MXFP4 or MXFP8, the
scheme's scale rule, Quark's default ``even``) read back through ``kernelbay.formats.mx``:
what an MX fused-MoE kernel feeds both GEMMs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar, cast

from kernelbay.layers.linear import TensorSpec
from kernelbay.layers.moe import MoEMethod, combine_experts, expert_tensor, swiglu
from kernelbay.requests import LinearRequest
from kernelbay.verdict import Verdict

from kernelbay_quant_mxfp4_rocm.devices import home_note
from kernelbay_quant_mxfp4_rocm.emulation import MX_ACTIVATIONS, mx_layer_checks
from kernelbay_quant_mxfp4_rocm.moe_backend import load_choice

if TYPE_CHECKING:
    import torch
    from kernelbay.device import DeviceCapability

__all__ = ["Mxfp4MoEEmulation"]

_BLOCK = 32
_FLOAT_DTYPES = ("float32", "bfloat16", "float16")


class Mxfp4MoEEmulation(MoEMethod):
    """Reference OCP MXFP4 routed experts on any device: every expert projection dequantized
    once through ``kernelbay.formats.mx``; dynamic MX activations fake-quantized with the
    scheme's scale rule; then the loop-over-experts SwiGLU of ``TorchMoE``."""

    name: ClassVar[str] = "mxfp4-moe-emulation"
    api_version: ClassVar[str] = "1.0"
    priority: ClassVar[int] = 10
    batch_invariant: ClassVar[bool] = True
    summary: ClassVar[str] = "OCP MXFP4 routed experts (W4A16/W4A4/W4A8) through the reference"

    @classmethod
    def can_implement(cls, request: LinearRequest, device: DeviceCapability) -> Verdict:
        r = request
        verdict = Verdict.all(
            cls.routed_expert_checks(r),
            mx_layer_checks(r.scheme, "experts"),
            Verdict.check(r.in_features > 0 and r.in_features % _BLOCK == 0,
                          f"hidden size K={r.in_features} is not a multiple of the MX block "
                          f"{_BLOCK}"),
            Verdict.check(r.out_features > 0 and r.out_features % _BLOCK == 0,
                          f"expert intermediate size {r.out_features} (this rank's) is not a "
                          f"multiple of the MX block {_BLOCK}, which down_proj's K needs"),
        )
        if not verdict.accepted:
            return verdict
        notes = [home_note(device), load_choice().describe()]
        s = r.scheme
        if s.activation is not None:
            rule = s.option("scale_mode", "even")
            notes.append(f"activations fake-quantized {s.activation} (scale rule {rule})")
        return Verdict.accept(*notes)

    @property
    def _activation_elem(self) -> str | None:
        activation = self.request.scheme.activation
        return None if activation is None else MX_ACTIVATIONS[activation]

    def tensor_specs(self) -> Mapping[str, TensorSpec]:
        specs: dict[str, TensorSpec] = {}
        for e, proj, n, k, shard in self.projections():
            # E8M0 scales follow their weight; a rank's K share is whole blocks
            # (can_implement checks the intermediate size).
            specs[expert_tensor(e, proj)] = TensorSpec((n, k // 2), "uint8", shard)
            specs[expert_tensor(e, proj, "weight_scale")] = TensorSpec(
                (n, k // _BLOCK), "uint8", shard)
        return specs

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Dequantize every expert projection once and stack them: ``w13`` [E, 2I, H] (gate
        rows, then up rows) and ``w2`` [E, H, I], in float32 when activations are quantized
        (the matmuls run in float32), else in the activation dtype."""
        import torch
        from kernelbay.formats import dequantize_mx

        dtype = (torch.float32 if self._activation_elem is not None
                 else getattr(torch, self.request.activation_dtype))
        packed13, packed2 = self.stack_experts(layer, "weight")
        scales13, scales2 = self.stack_experts(layer, "weight_scale")
        w13 = dequantize_mx(packed13, scales13, "e2m1").to(dtype)
        w2 = dequantize_mx(packed2, scales2, "e2m1").to(dtype)
        layer.w13 = torch.nn.Parameter(w13, requires_grad=False)
        layer.w2 = torch.nn.Parameter(w2, requires_grad=False)

    def apply_moe(self, layer: torch.nn.Module, x: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F

        from kernelbay_quant_mxfp4_rocm.emulation import fake_quantize_mx

        w13 = getattr(layer, "w13", None)
        if w13 is None:
            raise RuntimeError(f"{self.name}: call process_weights_after_loading(layer) before "
                               "apply_moe; the dequantized experts are made there")
        w2 = cast("torch.Tensor", layer.w2)
        elem = self._activation_elem
        rule = self.request.scheme.option("scale_mode", "even") or "even"
        # MX blocks lie within one token's row: quantizing all rows once is the same as
        # quantizing each expert's rows.
        xq = x if elem is None else fake_quantize_mx(x, elem, rule)

        def expert_mlp(expert: int, tokens: torch.Tensor) -> torch.Tensor:
            gate_up = F.linear(xq[tokens], w13[expert])
            h = swiglu(gate_up)
            if elem is not None:
                h = fake_quantize_mx(h, elem, rule)
            return F.linear(h, w2[expert])

        return combine_experts(x, topk_ids, topk_weights, w2.shape[1], expert_mlp,
                               num_experts=self.num_experts)
