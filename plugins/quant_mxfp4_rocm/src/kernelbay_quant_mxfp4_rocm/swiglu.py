"""The reference of the fused SwiGLU + MX quantization: ``silu(gate) * up`` in float32, then
``kernelbay.formats.quantize_mx``.

Math (the one definition the Triton kernel ``triton_mx.swiglu_quantize_mx`` is tested
against)::

    h = silu(float32(gate)) * float32(up)        float32, no rounding to the input dtype
    data, scales = quantize_mx(h, elem, rule)    kernelbay.formats.mx

The intermediate is float32 whatever the input dtype, because that is what the MX-activation
MoE reference (``mxfp4-moe-emulation``) feeds its down projection: with MX activations its
gate/up products are float32 and ``F.silu(gate) * up`` runs in float32. A bf16 MLP that
rounded ``silu(gate)`` and the product to bf16 first would quantize different numbers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["swiglu_quantize_mx_reference"]


def swiglu_quantize_mx_reference(gate: torch.Tensor, up: torch.Tensor, elem: str = "e4m3",
                                 rule: str = "even") -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_mx(silu(gate.float()) * up.float(), elem, rule)``: MX data and E8M0 scale
    bytes of the SwiGLU product of ``gate`` and ``up`` ([..., K], K a multiple of 32)."""
    import torch.nn.functional as F
    from kernelbay.formats import quantize_mx

    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate has shape {tuple(gate.shape)} and up "
                         f"{tuple(up.shape)}; they must be equal")
    h = F.silu(gate.float()) * up.float()
    return quantize_mx(h, elem, rule)  # type: ignore[arg-type]
