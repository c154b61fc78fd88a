"""Fused NVFP4 MoE: the scale folding of FP4 fused-MoE kernels (reference, torch) and a
Triton method for GPUs (per-expert weight-only GEMMs through ``nvfp4-triton``'s kernel,
driven by the routing).

Scalars per expert ``e`` (FORMATS.md), with ``a13`` the gate/up input scale, ``a2`` the down
input scale and ``w*_scale_2`` the weights' global scales (one per gate, up, down)::

    g1_alphas  = a13 * w13_scale_2         GEMM1 output -> real units          [E, 2] (gate, up)
    a1_gscale  = 1 / a13                   x -> GEMM1's FP4 input domain        [E]
    a2_gscale  = 1 / a2                    h -> GEMM2's FP4 input domain        [E]
    g2_alphas  = a2 * w2_scale_2           GEMM2 output -> real units           [E]
    g1_scale_c = g1_alphas * a2_gscale     GEMM1 output -> GEMM2's input domain [E, 2]

Fused W4A4 expert (``raw`` = block-scaled FP4 products, global scales outside)::

    raw1        = FP4(x * a1_gscale) @ FP4raw(w13)^T           GEMM1, per gate and up rows
    gate        = raw1_gate * g1_alphas_gate                    BEFORE SiLU: real units
    up_dom      = raw1_up * g1_scale_c_up                       the fold, on the linear branch
    h_dom       = SiLU(gate) * up_dom                           = SiLU(gate) * up * a2_gscale
    y_e         = (FP4(h_dom) @ FP4raw(w2)^T) * g2_alphas        GEMM2

SiLU is not homogeneous (SiLU(c t) != c SiLU(t)), so ``g1_scale_c`` may be applied to the
up branch (h is linear in up) but never to the gate branch before SiLU; the
``fold_through_activation=True`` switch of ``fused_moe_reference`` does exactly that wrong
fold, for the negative-control test. ``fused_moe_reference`` is checked against the unfused
``nvfp4-moe-emulation`` (fake-quantize with each input scale, dequantize, matmul).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, cast

from kernelbay.layers.linear import TensorSpec
from kernelbay.layers.moe import EXPERT_PROJECTIONS, MoEMethod, combine_experts, expert_tensor
from kernelbay.requests import LinearRequest
from kernelbay.verdict import Verdict

from kernelbay_quant_nvfp4.linear_triton import gpu_triton_checks
from kernelbay_quant_nvfp4.moe import expert_block_checks, expert_specs
from kernelbay_quant_nvfp4.schemes import W4A4_ACTIVATION, nvfp4_layer_checks

if TYPE_CHECKING:
    import torch
    from kernelbay.device import DeviceCapability

__all__ = ["MoEScales", "Nvfp4FusedExperts", "Nvfp4MoETriton", "fold_moe_scales",
           "fused_moe_reference"]


@dataclass(frozen=True)
class MoEScales:
    """The folded fused-MoE scalars (see the module doc), fp32."""

    g1_alphas: torch.Tensor  # [E, 2] gate, up
    a1_gscale: torch.Tensor  # [E]
    a2_gscale: torch.Tensor  # [E]
    g2_alphas: torch.Tensor  # [E]
    g1_scale_c: torch.Tensor  # [E, 2]


def fold_moe_scales(a13: torch.Tensor, w13_scale_2: torch.Tensor, a2: torch.Tensor,
                    w2_scale_2: torch.Tensor) -> MoEScales:
    """Fold per-expert input scales ``a13`` [E] (gate and up share it, as ModelOpt exports
    them and a fused GEMM1 needs), ``a2`` [E] and weight global scales ``w13_scale_2`` [E, 2],
    ``w2_scale_2`` [E] into the fused-MoE scalars."""
    a13, a2 = a13.float(), a2.float()
    g1_alphas = a13[:, None] * w13_scale_2.float()
    a2_gscale = 1.0 / a2
    return MoEScales(g1_alphas, 1.0 / a13, a2_gscale, a2 * w2_scale_2.float(),
                     g1_alphas * a2_gscale[:, None])


@dataclass(frozen=True)
class Nvfp4FusedExperts:
    """Stacked raw NVFP4 experts: ``w13`` uint8 [E, 2I, H/2] (gate rows then up rows) with
    block scales ``w13_bs`` E4M3 [E, 2I, H/16]; ``w2`` uint8 [E, H, I/2], ``w2_bs`` [E, H, I/16]."""

    w13: torch.Tensor
    w13_bs: torch.Tensor
    w2: torch.Tensor
    w2_bs: torch.Tensor


def _fp4_domain(t: torch.Tensor) -> torch.Tensor:
    """``t`` quantized to NVFP4 with global scale 1 and read back (block scales applied):
    what an FP4 GEMM multiplies once its input is in the FP4 domain."""
    import torch
    from kernelbay.formats import dequantize_nvfp4, quantize_nvfp4

    one = torch.tensor(1.0, device=t.device)
    packed, scales, _ = quantize_nvfp4(t, one)
    return dequantize_nvfp4(packed, scales, one)


def fused_moe_reference(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                        experts: Nvfp4FusedExperts, scales: MoEScales, *,
                        fold_through_activation: bool = False) -> torch.Tensor:
    """W4A4 NVFP4 MoE the way a fused FP4 kernel computes it, with the folded scalars (module
    doc), in float32; returns [T, H] in x's dtype. ``fold_through_activation=True`` applies
    ``g1_scale_c`` to the gate before SiLU (and only ``g1_alphas`` to up): the invalid fold,
    kept for the negative control."""
    import torch
    import torch.nn.functional as F
    from kernelbay.formats import dequantize_nvfp4

    one = torch.tensor(1.0, device=x.device)
    inter = experts.w2.shape[-1] * 2

    def expert_mlp(e: int, tokens: torch.Tensor) -> torch.Tensor:
        xe = _fp4_domain(x[tokens].float() * scales.a1_gscale[e])
        raw1 = xe @ dequantize_nvfp4(experts.w13[e], experts.w13_bs[e], one).T
        raw_gate, raw_up = raw1[:, :inter], raw1[:, inter:]
        if fold_through_activation:
            h_dom = F.silu(raw_gate * scales.g1_scale_c[e, 0]) * (raw_up * scales.g1_alphas[e, 1])
        else:
            gate = raw_gate * scales.g1_alphas[e, 0]  # real units before the nonlinearity
            up_dom = raw_up * scales.g1_scale_c[e, 1]  # a2_gscale folded on the linear branch
            h_dom = F.silu(gate) * up_dom
        raw2 = _fp4_domain(h_dom) @ dequantize_nvfp4(experts.w2[e], experts.w2_bs[e], one).T
        return raw2 * scales.g2_alphas[e]

    return combine_experts(x, topk_ids, topk_weights, experts.w2.shape[1], expert_mlp,
                           num_experts=experts.w2.shape[0])


class Nvfp4MoETriton(MoEMethod):
    """NVFP4 routed experts on GPUs, weight-only: every expert projection through the
    ``nvfp4-triton`` kernel (weights decoded in registers), per expert with the tokens routed
    to it; SiLU(gate) * up between, in the activation dtype."""

    name: ClassVar[str] = "nvfp4-moe-triton"
    api_version: ClassVar[str] = "1.0"
    priority: ClassVar[int] = 30
    # An expert's kernel (and its split of K) follows how many rows are routed to it, so a
    # token's result can change with the batch.
    batch_invariant: ClassVar[bool] = False
    summary: ClassVar[str] = ("NVFP4 routed experts, weight-only Triton GEMMs per expert; "
                              "CUDA cc >= 8.0 / ROCm")

    @classmethod
    def can_implement(cls, request: LinearRequest, device: DeviceCapability) -> Verdict:
        r = request
        s = r.scheme
        verdict = Verdict.all(
            cls.routed_expert_checks(r),
            nvfp4_layer_checks(s, "experts", f"runs weight-only NVFP4 (activations None, or "
                                              f"{W4A4_ACTIVATION!r} read as weight-only)"),
            gpu_triton_checks(device),
            Verdict.check(r.activation_dtype in ("bfloat16", "float16"),
                          f"needs activation dtype in ('bfloat16', 'float16'), request has "
                          f"{r.activation_dtype!r}"),
            expert_block_checks(r),
        )
        if verdict.accepted and s.activation is not None:
            return Verdict.accept("weight-only: the experts' input_scale is not used")
        return verdict

    def tensor_specs(self) -> Mapping[str, TensorSpec]:
        # weight-only: a W4A4 checkpoint's input scales are read if present, never used
        return expert_specs(self, False if self.request.scheme.activation is not None else None)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Stack per projection: ``{proj}_w`` and ``{proj}_bs`` (``stored_tensors``: the weight
        and block scales [E, N, K/16] in the layout of the linear method's M table),
        ``{proj}_g`` fp32 [E, 1] (buffers); the per-expert parameters go."""
        import torch

        from kernelbay_quant_nvfp4.linear_triton import (
            Nvfp4TritonLinear,
            check_finite_scales,
            stored_tensors,
        )
        from kernelbay_quant_nvfp4.triton_configs import KernelConfig, table_for

        params = layer._parameters
        self.tables: dict[str, tuple[tuple[int, KernelConfig], ...]] = {}

        def take(e: int, proj: str, tensor: str) -> torch.Tensor:
            return cast("torch.Tensor", params.pop(expert_tensor(e, proj, tensor))).data

        for proj in EXPERT_PROJECTIONS:
            w, bs, g = [], [], []
            for e in range(self.num_experts):
                w.append(take(e, proj, "weight"))
                bs.append(take(e, proj, "weight_scale"))
                g.append(take(e, proj, "weight_scale_2").float().reshape(1))
                check_finite_scales(self.name, bs[-1], g[-1], f"experts.{e}.{proj}.")
                params.pop(expert_tensor(e, proj, "input_scale"), None)
            # the table is kept: it says which layout the stacked weight is in
            self.tables[proj] = table_for(w[0].shape[0], w[0].shape[-1] * 2,
                                          Nvfp4TritonLinear.configs)
            weights, scales = stored_tensors(torch.stack(w), torch.stack(bs), self.tables[proj])
            layer.register_buffer(f"{proj}_w", weights, persistent=False)
            layer.register_buffer(f"{proj}_bs", scales, persistent=False)
            layer.register_buffer(f"{proj}_g", torch.stack(g), persistent=False)

    def apply_moe(self, layer: torch.nn.Module, x: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F

        from kernelbay_quant_nvfp4.linear_triton import run_config
        from kernelbay_quant_nvfp4.triton_configs import config_for

        def gemm(proj: str, e: int, t: torch.Tensor) -> torch.Tensor:
            config = config_for(t.shape[0], self.tables[proj])
            return run_config(config, t, getattr(layer, f"{proj}_w")[e],
                              getattr(layer, f"{proj}_bs")[e], getattr(layer, f"{proj}_g")[e],
                              None)

        def expert_mlp(e: int, tokens: torch.Tensor) -> torch.Tensor:
            xe = x[tokens].contiguous()
            # Weight-only: each GEMM applies its own weight_scale_2 in the kernel, so the
            # gate is in real units before SiLU.
            h = F.silu(gemm("gate_proj", e, xe)) * gemm("up_proj", e, xe)
            return gemm("down_proj", e, h.contiguous())

        return combine_experts(x, topk_ids, topk_weights, self.hidden_size, expert_mlp,
                               num_experts=self.num_experts)
