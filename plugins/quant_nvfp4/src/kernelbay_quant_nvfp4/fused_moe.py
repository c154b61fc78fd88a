"""Fused NVFP4 MoE: the scale folding of FP4 fused-MoE kernels (reference, torch) and a
Triton method for GPUs (grouped weight-only GEMMs over every routed expert, a fixed handful of
launches per layer: ``triton_grouped``).

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

    from kernelbay_quant_nvfp4.grouped_weights import ExpertWeight

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
    """NVFP4 routed experts on GPUs, weight-only: one grouped kernel for gate and up of every
    routed expert (weights decoded in registers as ``nvfp4-triton`` does, SiLU(gate) * up in
    float32, stored in the activation dtype), one for down times the routing weights; the
    K slots of each token added in float32."""

    name: ClassVar[str] = "nvfp4-moe-triton"
    api_version: ClassVar[str] = "1.0"
    priority: ClassVar[int] = 30
    # A token's rows share blocks with other tokens', and the block height follows the batch
    # (``triton_grouped.block_m_for``): the tile shape of the dot can change with the batch.
    batch_invariant: ClassVar[bool] = False
    summary: ClassVar[str] = ("NVFP4 routed experts, weight-only grouped Triton GEMMs (two "
                              "launches); CUDA cc >= 8.0 / ROCm")

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
        """Stack each projection over the experts in the layout of ``nvfp4-triton``'s table
        for its shape (``stored_tensors``), pair gate and up (``grouped_weights``), and keep
        them as buffers: ``w13_w`` / ``w13_bs`` / ``w13_g`` / ``w13_ug`` (paired words, scale
        bytes, gate and up ``weight_scale_2`` [E, 1] fp32) and ``w2_w`` / ``w2_bs`` /
        ``w2_g``; the per-expert parameters go."""
        import torch

        from kernelbay_quant_nvfp4.grouped_weights import (
            expert_weight,
            pair_turn,
            paired_weight,
        )
        from kernelbay_quant_nvfp4.linear_triton import (
            Nvfp4TritonLinear,
            check_finite_scales,
            stored_tensors,
        )
        from kernelbay_quant_nvfp4.triton_configs import table_for, table_layout

        params = layer._parameters

        def take(e: int, proj: str, tensor: str) -> torch.Tensor:
            return cast("torch.Tensor", params.pop(expert_tensor(e, proj, tensor))).data

        stacked: dict[str, ExpertWeight] = {}
        for proj in EXPERT_PROJECTIONS:
            w, bs, g = [], [], []
            for e in range(self.num_experts):
                w.append(take(e, proj, "weight"))
                bs.append(take(e, proj, "weight_scale"))
                g.append(take(e, proj, "weight_scale_2").float().reshape(1))
                check_finite_scales(self.name, bs[-1], g[-1], f"experts.{e}.{proj}.")
                params.pop(expert_tensor(e, proj, "input_scale"), None)
            n, k = w[0].shape[0], w[0].shape[-1] * 2
            table = table_for(n, k, Nvfp4TritonLinear.configs)
            words, scales = stored_tensors(torch.stack(w), torch.stack(bs), table)
            del w, bs
            stacked[proj] = expert_weight(words, scales, torch.stack(g), table_layout(table),
                                          n, k)
        gate_up = paired_weight(stacked.pop("gate_proj"), stacked.pop("up_proj"),
                                pair_turn(self.intermediate_size))
        down = stacked.pop("down_proj")
        self.layouts = (gate_up.layout, down.layout)
        self.turn, self.gate_up_rows = gate_up.turn, gate_up.rows
        for name, value in (("w13_w", gate_up.words), ("w13_bs", gate_up.scales),
                            ("w13_g", gate_up.global_scale), ("w13_ug", gate_up.up_scale),
                            ("w2_w", down.words), ("w2_bs", down.scales),
                            ("w2_g", down.global_scale)):
            layer.register_buffer(name, value, persistent=False)

    def stored_weights(self, layer: torch.nn.Module) -> tuple[ExpertWeight, ExpertWeight]:
        """The layer's paired gate/up and down weights as the grouped kernels read them."""
        from kernelbay_quant_nvfp4.grouped_weights import ExpertWeight

        def buffer(name: str) -> torch.Tensor:
            return cast("torch.Tensor", getattr(layer, name))

        hidden, inter = self.hidden_size, self.intermediate_size
        gate_up = ExpertWeight(buffer("w13_w"), buffer("w13_bs"), buffer("w13_g"),
                               self.layouts[0], inter, hidden, self.gate_up_rows, self.turn,
                               buffer("w13_ug"))
        down = ExpertWeight(buffer("w2_w"), buffer("w2_bs"), buffer("w2_g"), self.layouts[1],
                            hidden, inter, hidden)
        return gate_up, down

    def apply_moe(self, layer: torch.nn.Module, x: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor) -> torch.Tensor:
        """Two grouped kernel launches for every routed expert (``triton_grouped``), the
        routing grouped by expert on the device (``kernelbay.layers.expert_blocks``): nothing
        is read on the host, so a decode step with this layer is captured as it runs."""
        from kernelbay.layers.expert_blocks import expert_blocks

        from kernelbay_quant_nvfp4.triton_grouped import block_m_for, nvfp4_grouped_experts

        if getattr(layer, "w13_w", None) is None:
            raise RuntimeError(f"{self.name}: call process_weights_after_loading(layer) before "
                               "apply_moe; the stacked experts are made there")
        # float32 before the first launch, so that no conversion kernel separates the GEMMs
        # (inside a CUDA graph each launch then depends programmatically on the one before)
        topk_weights = topk_weights.float().contiguous()
        blocks = expert_blocks(topk_ids, self.num_experts,
                               block_m_for(topk_ids.numel(), self.num_experts))
        return nvfp4_grouped_experts(x, blocks, topk_weights, *self.stored_weights(layer))
