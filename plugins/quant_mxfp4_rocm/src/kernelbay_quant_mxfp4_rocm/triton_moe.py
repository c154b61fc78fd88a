"""``mxfp4-moe-triton``: OCP MXFP4 routed experts on the Triton kernels, per expert.

Math (``mxfp4-moe-emulation``'s, which the tests compare with), for the tokens routed to
expert e::

    weight-only:    gu = mxfp4_gemm(x, W13[e])                     bf16 [T_e, 2I]
                    h  = silu(gu[:, :I]) * gu[:, I:]                bf16 (torch, as TorchMoE)
                    y  = mxfp4_gemm(h, W2[e])
    MX activations: xq, xs = quantize_mx(x)                        once for all tokens
                    gu = mxfp4_gemm(xq[tok], W13[e], x_scale=xs[tok])   float32
                    hq, hs = swiglu_quantize_mx(gu[:, :I], gu[:, I:])   fused kernel
                    y  = mxfp4_gemm(hq, W2[e], x_scale=hs)               float32

then ``combine_experts`` weights and sums. The fused SwiGLU kernel computes ``silu * up`` in
float32 like the emulation and quantizes with the same rule (``swiglu.py`` is its reference).
Chosen by ``KERNELBAY_MXFP4_MOE_BACKEND`` (``moe_backend``): ``auto`` on ROCm
gfx942/gfx950, ``triton`` also on CUDA.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, cast

from kernelbay.requests import LinearRequest
from kernelbay.verdict import Verdict

from kernelbay_quant_mxfp4_rocm.devices import (
    ROCM_HOME_ARCHS,
    native_note,
    triton_present,
)
from kernelbay_quant_mxfp4_rocm.moe import Mxfp4MoEEmulation
from kernelbay_quant_mxfp4_rocm.moe_backend import BACKEND_VARIABLE, load_choice

if TYPE_CHECKING:
    import torch
    from kernelbay.device import DeviceCapability

__all__ = ["Mxfp4MoETriton"]


def _tensor(layer: torch.nn.Module, name: str) -> torch.Tensor:
    """The data of the layer's parameter ``name``."""
    return cast("torch.Tensor", getattr(layer, name).data)


class Mxfp4MoETriton(Mxfp4MoEEmulation):
    """OCP MXFP4 routed experts on Triton: MXFP4 GEMMs with weights dequantized in registers,
    dynamic MX activations quantized by Triton, SiLU(gate)*up fused with the MX quantization
    of the down projection's input."""

    name: ClassVar[str] = "mxfp4-moe-triton"
    api_version: ClassVar[str] = "1.0"
    priority: ClassVar[int] = 50
    batch_invariant: ClassVar[bool] = False  # split-K and tile shapes depend on M
    summary: ClassVar[str] = "OCP MXFP4 routed experts on Triton (fused SwiGLU + MX quantize)"

    @classmethod
    def can_implement(cls, request: LinearRequest, device: DeviceCapability) -> Verdict:
        base = Mxfp4MoEEmulation.can_implement(request, device)
        if not base.accepted:
            return base
        choice = load_choice()
        home = device.platform == "rocm" and device.arch in ROCM_HOME_ARCHS
        verdict = Verdict.all(
            Verdict.handles(choice.backend != "emulation",
                            f"{choice.describe()} selects mxfp4-moe-emulation"),
            Verdict.check(request.activation_dtype == "bfloat16",
                          f"needs bfloat16 activations (the kernels' MMA type), request has "
                          f"{request.activation_dtype!r}"),
            Verdict.check(home or (device.platform == "cuda" and choice.backend == "triton"),
                          f"runs on ROCm {'/'.join(ROCM_HOME_ARCHS)} (on CUDA only with "
                          f"{BACKEND_VARIABLE}=triton), device is {device.platform} "
                          f"{device.arch}; {choice.describe()}"),
            triton_present(),
        )
        if not verdict.accepted:
            return verdict
        where = (native_note(device) if home else
                 "ROCm-first kernels on CUDA, offered because of the variable")
        return Verdict.accept(choice.describe(), where)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Stack every expert's packed weights and scale bytes (``w13`` [E, 2I, H/2] gate
        rows then up rows, ``w2`` [E, H, I/2], scales alike) and check the scales once."""
        import torch

        from kernelbay_quant_mxfp4_rocm.triton_gemm import prepare_weight_scales

        packed13, packed2 = self.stack_experts(layer, "weight")
        scales13, scales2 = self.stack_experts(layer, "weight_scale")
        # the largest scale byte of each stack selects the GEMM's decode (scale_max)
        top13 = prepare_weight_scales(scales13, f"{self.name}: gate/up weight_scale")
        top2 = prepare_weight_scales(scales2, f"{self.name}: down weight_scale")
        object.__setattr__(layer, "mxfp4_scale_max13", top13)
        object.__setattr__(layer, "mxfp4_scale_max2", top2)
        for name, value in (("w13", packed13), ("w13_scale", scales13), ("w2", packed2),
                            ("w2_scale", scales2)):
            setattr(layer, name, torch.nn.Parameter(value.contiguous(), requires_grad=False))

    def apply_moe(self, layer: torch.nn.Module, x: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor) -> torch.Tensor:
        import torch
        import torch.nn.functional as F
        from kernelbay.layers.moe import combine_experts

        from kernelbay_quant_mxfp4_rocm import triton_mx
        from kernelbay_quant_mxfp4_rocm.triton_gemm import mxfp4_gemm

        if getattr(layer, "w13_scale", None) is None:
            raise RuntimeError(f"{self.name}: call process_weights_after_loading(layer) before "
                               "apply_moe; the stacked experts are made there")
        w13, s13 = _tensor(layer, "w13"), _tensor(layer, "w13_scale")
        w2, s2 = _tensor(layer, "w2"), _tensor(layer, "w2_scale")
        top13 = getattr(layer, "mxfp4_scale_max13", None)
        top2 = getattr(layer, "mxfp4_scale_max2", None)
        inter = int(w2.shape[-1]) * 2
        elem = self._activation_elem
        rule = self.request.scheme.option("scale_mode", "even") or "even"
        if elem is not None:  # blocks lie within a token's row: quantize all rows once
            xq, xs = triton_mx.quantize_mx(x, elem, rule)

        def expert_mlp(expert: int, tokens: torch.Tensor) -> torch.Tensor:
            if elem is None:
                gu = mxfp4_gemm(x[tokens], w13[expert], s13[expert], scale_max=top13)
                h = F.silu(gu[:, :inter]) * gu[:, inter:]
                return mxfp4_gemm(h, w2[expert], s2[expert], scale_max=top2)
            gu = mxfp4_gemm(xq[tokens], w13[expert], s13[expert], x_scale=xs[tokens],
                            out_dtype=torch.float32, scale_max=top13)
            hq, hs = triton_mx.swiglu_quantize_mx(gu[:, :inter], gu[:, inter:], elem, rule)
            return mxfp4_gemm(hq, w2[expert], s2[expert], x_scale=hs, out_dtype=torch.float32,
                              scale_max=top2)

        return combine_experts(x, topk_ids, topk_weights, int(w2.shape[1]), expert_mlp,
                               num_experts=self.num_experts)
