"""``mxfp4-moe-triton``: OCP MXFP4 routed experts on Triton, every routed expert of the layer
in one grouped GEMM launch per projection.

The routed slots (token t's k-th expert is slot ``t * K + k``) are grouped by expert on the
device (``kernelbay.layers.expert_blocks``), and ``triton_grouped.grouped_mxfp4_gemm`` runs
each block of one expert's slots against that expert's weight. Math
(``mxfp4-moe-emulation``'s, which the tests compare with), per slot s of expert e::

    weight-only:    g, u = x[s // K] @ W13[e]^T (gate, up rows)    float32, one GEMM
                    h[s] = silu(g) * u                              stored in bf16
                    y[s] = w[s] * (h[s] @ W2[e]^T)                  float32
    MX activations: xq, xs = quantize_mx(x)                        once for all tokens
                    gu[s] = dec(xq, xs)[s // K] @ W13[e]^T         float32
                    hq, hs = swiglu_quantize_mx(gu[:, :I], gu[:, I:])   fused kernel
                    y[s] = w[s] * (dec(hq, hs)[s] @ W2[e]^T)        float32

``dec`` is ``triton_gemm.decode_activations`` (the MX values, exact in bf16 but for E4M3
subnormals of blocks with X < -118, rounded once as the reference rounds them) and ``w[s]``
the slot's routing weight; then ``out[t] = sum_k y[t * K + k]`` in float32, in slot order,
rounded to x's dtype (``kernelbay.layers.slot_sum``: one launch on CUDA). (The emulation
rounds gate/up to bf16 before SiLU, as ``TorchMoE`` does; the fused weight-only path rounds
once, after it.) Nothing is read on the host, so the
layer runs inside a captured CUDA graph as it runs eagerly (the per-expert loop it replaced
read the routing on the host, and a captured step ran every expert on every token, or was
refused). The fused SwiGLU kernel computes ``silu * up`` in
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
    """OCP MXFP4 routed experts on Triton: the routing grouped by expert on the device, two
    grouped MXFP4 GEMMs with weights dequantized in registers, dynamic MX activations
    quantized by Triton, SiLU(gate)*up fused with the MX quantization of the down
    projection's input."""

    name: ClassVar[str] = "mxfp4-moe-triton"
    api_version: ClassVar[str] = "1.0"
    priority: ClassVar[int] = 50
    batch_invariant: ClassVar[bool] = False  # rows per block depend on the batch
    summary: ClassVar[str] = ("OCP MXFP4 routed experts on Triton (grouped GEMMs, fused "
                              "SwiGLU + MX quantize)")

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
        rows then up rows, ``w2`` [E, H, I/2], scales alike), store the weights in the layout
        the grouped GEMM reads best here (``triton_grouped.prepare_experts``: fragment-order
        words on CUDA) and check the scales once."""
        import torch

        from kernelbay_quant_mxfp4_rocm.triton_gemm import prepare_weight_scales
        from kernelbay_quant_mxfp4_rocm.triton_grouped import prepare_experts

        packed13, packed2 = self.stack_experts(layer, "weight")
        scales13, scales2 = self.stack_experts(layer, "weight_scale")
        # the largest scale byte of each stack selects the GEMM's decode (scale_max)
        top13 = prepare_weight_scales(scales13, f"{self.name}: gate/up weight_scale")
        top2 = prepare_weight_scales(scales2, f"{self.name}: down weight_scale")
        object.__setattr__(layer, "mxfp4_scale_max13", top13)
        object.__setattr__(layer, "mxfp4_scale_max2", top2)
        for name, value in (("w13", prepare_experts(packed13)), ("w13_scale", scales13),
                            ("w2", prepare_experts(packed2)), ("w2_scale", scales2)):
            setattr(layer, name, torch.nn.Parameter(value.contiguous(), requires_grad=False))

    def apply_moe(self, layer: torch.nn.Module, x: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor) -> torch.Tensor:
        import torch
        from kernelbay.layers.expert_blocks import expert_blocks
        from kernelbay.layers.slot_sum import sum_slots

        from kernelbay_quant_mxfp4_rocm import triton_mx
        from kernelbay_quant_mxfp4_rocm.triton_gemm import decode_activations
        from kernelbay_quant_mxfp4_rocm.triton_grouped import block_rows, grouped_mxfp4_gemm

        if getattr(layer, "w13_scale", None) is None:
            raise RuntimeError(f"{self.name}: call process_weights_after_loading(layer) before "
                               "apply_moe; the stacked experts are made there")
        w13, s13 = _tensor(layer, "w13"), _tensor(layer, "w13_scale")
        w2, s2 = _tensor(layer, "w2"), _tensor(layer, "w2_scale")
        top13 = getattr(layer, "mxfp4_scale_max13", None)
        top2 = getattr(layer, "mxfp4_scale_max2", None)
        tokens, top_k = topk_ids.shape
        hidden, inter = int(s2.shape[1]), int(s2.shape[-1]) * 32  # w2's layout may vary
        if tokens == 0:
            return torch.zeros(0, hidden, dtype=x.dtype, device=x.device)
        elem = self._activation_elem
        rule = self.request.scheme.option("scale_mode", "even") or "even"
        # float32 before the first launch, so that no conversion kernel separates the GEMMs
        # (inside a CUDA graph each launch then depends programmatically on the one before)
        topk_weights = topk_weights.to(torch.float32).contiguous()
        blocks = expert_blocks(topk_ids, self.num_experts,
                               block_rows(topk_ids.numel(), self.num_experts))
        # MX activations: quantized once for all tokens (blocks lie within a row), decoded to
        # their exact bf16 values once, then gathered by slot like bf16 ones
        xb = x if elem is None else decode_activations(*triton_mx.quantize_mx(x, elem, rule))
        if elem is None:  # SiLU(gate) * up in the gate/up GEMM, stored in bf16
            h = grouped_mxfp4_gemm(xb, w13, s13, blocks, gather=True, gated=True,
                                   out_dtype=torch.bfloat16, scale_max=top13)
        else:  # float32 gate/up, then the fused SwiGLU + MX quantizer
            gu = grouped_mxfp4_gemm(xb, w13, s13, blocks, gather=True, out_dtype=torch.float32,
                                    scale_max=top13)
            h = decode_activations(*triton_mx.swiglu_quantize_mx(gu[:, :inter], gu[:, inter:],
                                                                 elem, rule))
        y = grouped_mxfp4_gemm(h, w2, s2, blocks, gather=False, routing_weights=topk_weights,
                               out_dtype=torch.float32, scale_max=top2)
        # each token's weighted slot outputs added in slot order in float32 and rounded to
        # x's dtype, in one launch on CUDA
        return sum_slots(y, top_k, x.dtype)
