"""``nvfp4-moe-emulation``: NVFP4 routed experts through the one reference, then the
reference MoE math of ``kernelbay.layers.moe``.

Per expert ``e`` and projection ``p`` (gate, up, down) the checkpoint holds the tensors of an
NVFP4 linear layer under ``experts.{e}.{p}_proj.*`` (``weight`` uint8 [N, K/2],
``weight_scale`` float8_e4m3fn [N, K/16], ``weight_scale_2`` fp32 [], and ``input_scale``
fp32 [] for W4A4). After loading, every projection is dequantized once with
``kernelbay.formats.dequantize_nvfp4``. For token t routed to expert e with weight w::

    weight-only:  h = SiLU(x W_gate^T) * (x W_up^T);  y[t] += w * (h W_down^T)   in x's dtype
    W4A4:         x_g = fq(x, a_gate[e]), x_u = fq(x, a_up[e])                  fp32
                  h   = SiLU(x_g W_gate^T) * (x_u W_up^T);  h_q = fq(h, a_down[e])
                  y[t] += w * (h_q W_down^T)                                     in fp32

``fq`` is ``emulation.fake_quantize_nvfp4`` (NVFP4 with the static ``input_scale`` as the
global scale, block scales from the tokens), which is what a W4A4 fused-MoE kernel feeds its
two GEMMs; the dequantization factors sit before the SiLU, as FORMATS.md requires.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar, cast

from kernelbay.layers.linear import TensorSpec
from kernelbay.layers.moe import (
    EXPERT_PROJECTIONS,
    MoEMethod,
    combine_experts,
    expert_tensor,
    swiglu,
)
from kernelbay.requests import LinearRequest
from kernelbay.verdict import Verdict

from kernelbay_quant_nvfp4.schemes import NVFP4_BLOCK, W4A4_ACTIVATION, nvfp4_layer_checks

if TYPE_CHECKING:
    import torch
    from kernelbay.device import DeviceCapability

__all__ = ["Nvfp4MoEEmulation", "expert_block_checks", "expert_specs"]


def expert_block_checks(request: LinearRequest) -> Verdict:
    """The hidden size K and this rank's expert intermediate size (down_proj's K) in whole
    NVFP4 blocks, as every NVFP4 expert method needs."""
    r = request
    return Verdict.all(
        Verdict.check(r.in_features > 0 and r.in_features % NVFP4_BLOCK == 0,
                      f"hidden size K={r.in_features} is not a multiple of the NVFP4 block "
                      f"{NVFP4_BLOCK}"),
        Verdict.check(r.out_features > 0 and r.out_features % NVFP4_BLOCK == 0,
                      f"expert intermediate size {r.out_features} (this rank's) is not a "
                      f"multiple of the NVFP4 block {NVFP4_BLOCK}, which down_proj's K "
                      "needs"),
    )


def expert_specs(method: MoEMethod, input_scale: bool | None) -> dict[str, TensorSpec]:
    """The NVFP4 tensors of every expert projection of ``method``; ``input_scale``: None for
    none, True when required, False when read if present."""
    specs: dict[str, TensorSpec] = {}
    for e, proj, n, k, shard in method.projections():
        # Block scales follow their weight (one row per row, one per 16 columns); a rank's K
        # share is whole blocks because expert_block_checks checks it.
        specs[expert_tensor(e, proj)] = TensorSpec((n, k // 2), "uint8", shard)
        specs[expert_tensor(e, proj, "weight_scale")] = TensorSpec(
            (n, k // NVFP4_BLOCK), "float8_e4m3fn", shard)
        specs[expert_tensor(e, proj, "weight_scale_2")] = TensorSpec((), "float32")
        if input_scale is not None:
            specs[expert_tensor(e, proj, "input_scale")] = TensorSpec(
                (), "float32", None, required=input_scale)
    return specs


class Nvfp4MoEEmulation(MoEMethod):
    """Reference NVFP4 routed experts on any device: every expert projection dequantized
    once through ``kernelbay.formats``; W4A4 activations fake-quantized with each
    projection's static ``input_scale``; then the loop-over-experts SwiGLU of ``TorchMoE``."""

    name: ClassVar[str] = "nvfp4-moe-emulation"
    api_version: ClassVar[str] = "1.0"
    priority: ClassVar[int] = 10
    batch_invariant: ClassVar[bool] = True
    summary: ClassVar[str] = "NVFP4 routed experts (W4A16/W4A4) through the reference, any device"

    @classmethod
    def can_implement(cls, request: LinearRequest, device: DeviceCapability) -> Verdict:
        del device  # plain torch
        r = request
        s = r.scheme
        verdict = Verdict.all(
            cls.routed_expert_checks(r),
            nvfp4_layer_checks(s, "experts",
                               f"emulates activations None or {W4A4_ACTIVATION!r}"),
            expert_block_checks(r),
        )
        if verdict.accepted and s.activation is not None:
            return Verdict.accept(f"activations fake-quantized {s.activation} with each "
                                  "projection's static input_scale, matmuls in float32")
        return verdict

    @property
    def w4a4(self) -> bool:
        """Whether activations are quantized (the scheme carries ``nvfp4-dynamic``)."""
        return self.request.scheme.activation == W4A4_ACTIVATION

    def tensor_specs(self) -> Mapping[str, TensorSpec]:
        return expert_specs(self, True if self.w4a4 else None)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Dequantize every expert projection once and stack them: ``w13`` [E, 2I, H] (gate
        rows, then up rows), ``w2`` [E, H, I], in float32 for W4A4 (the matmuls run in
        float32) else in the activation dtype; W4A4 keeps ``a13`` [E, 2] (gate, up) and
        ``a2`` [E] input scales."""
        import torch
        from kernelbay.formats import dequantize_nvfp4

        params = layer._parameters
        dtype = torch.float32 if self.w4a4 else getattr(torch, self.request.activation_dtype)

        def take(e: int, proj: str, tensor: str) -> torch.Tensor:
            return cast("torch.Tensor", params.pop(expert_tensor(e, proj, tensor))).data

        dense: dict[str, list[torch.Tensor]] = {p: [] for p in EXPERT_PROJECTIONS}
        scales: dict[str, list[torch.Tensor]] = {p: [] for p in EXPERT_PROJECTIONS}
        for e in range(self.num_experts):
            for proj in EXPERT_PROJECTIONS:
                dense[proj].append(dequantize_nvfp4(take(e, proj, "weight"),
                                                    take(e, proj, "weight_scale"),
                                                    take(e, proj, "weight_scale_2")).to(dtype))
                if self.w4a4:
                    scales[proj].append(take(e, proj, "input_scale").float())
        w13 = torch.stack([torch.cat([g, u]) for g, u in zip(dense["gate_proj"],
                                                              dense["up_proj"], strict=True)])
        layer.w13 = torch.nn.Parameter(w13, requires_grad=False)
        layer.w2 = torch.nn.Parameter(torch.stack(dense["down_proj"]), requires_grad=False)
        if self.w4a4:
            a13 = torch.stack([torch.stack(scales["gate_proj"]),
                               torch.stack(scales["up_proj"])], dim=1)
            layer.register_buffer("a13", a13, persistent=False)
            layer.register_buffer("a2", torch.stack(scales["down_proj"]), persistent=False)
            # decided here, on the host, so a forward reads no scale back (graph captures)
            self.shared_input_scale: list[bool] = (a13[:, 0] == a13[:, 1]).reshape(-1).tolist()

    def apply_moe(self, layer: torch.nn.Module, x: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F

        from kernelbay_quant_nvfp4.emulation import fake_quantize_nvfp4

        w13 = getattr(layer, "w13", None)
        if w13 is None:
            raise RuntimeError(f"{self.name}: call process_weights_after_loading(layer) before "
                               "apply_moe; the dequantized experts are made there")
        w2 = cast("torch.Tensor", layer.w2)
        inter = w2.shape[-1]

        def expert_mlp(expert: int, tokens: torch.Tensor) -> torch.Tensor:
            xe = x[tokens]
            if not self.w4a4:
                gate_up = F.linear(xe, w13[expert])
                return F.linear(swiglu(gate_up), w2[expert])
            w_gate, w_up = w13[expert, :inter], w13[expert, inter:]
            a13 = cast("torch.Tensor", layer.a13)
            a_gate, a_up = a13[expert, 0], a13[expert, 1]
            x_gate = fake_quantize_nvfp4(xe, a_gate)
            # gate and up usually share one input scale (ModelOpt exports them so).
            x_up = (x_gate if self.shared_input_scale[expert]
                    else fake_quantize_nvfp4(xe, a_up))
            h = F.silu(F.linear(x_gate, w_gate)) * F.linear(x_up, w_up)
            a2 = cast("torch.Tensor", layer.a2)
            return F.linear(fake_quantize_nvfp4(h, a2[expert]), w2[expert])

        return combine_experts(x, topk_ids, topk_weights, w2.shape[1], expert_mlp,
                               num_experts=self.num_experts)
