"""``bi-triton-moe``: unquantized routed experts whose expert GEMMs run on the
batch-invariant matmul (how many tokens reach an expert changes with the batch; a token's
row must not)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, cast

from kernelbay.layers.moe import TorchMoE, combine_experts
from kernelbay.requests import LinearRequest
from kernelbay.verdict import Verdict

from kernelbay_batch_invariant.checks import runs_on_cuda

if TYPE_CHECKING:
    import torch
    from kernelbay.device import DeviceCapability

__all__ = ["BatchInvariantMoE"]


class BatchInvariantMoE(TorchMoE):
    """SwiGLU experts (gather, two invariant GEMMs, weighted scatter-add in expert order)."""

    name: ClassVar[str] = "bi-triton-moe"
    api_version: ClassVar[str] = "1.0"
    # Above torch-moe, which declares invariance but runs cuBLAS on per-expert token counts.
    priority: ClassVar[int] = 1
    batch_invariant: ClassVar[bool] = True
    summary: ClassVar[str] = "unquantized routed experts on the batch-invariant Triton matmul"

    @classmethod
    def can_implement(cls, request: LinearRequest, device: DeviceCapability) -> Verdict:
        return Verdict.all(super().can_implement(request, device), runs_on_cuda(device))

    def apply_moe(self, layer: torch.nn.Module, x: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F

        from kernelbay_batch_invariant.configs import weight_config
        from kernelbay_batch_invariant.kernels import invariant_matmul

        w13 = cast("torch.Tensor", layer.w13)
        w2 = cast("torch.Tensor", layer.w2)
        inter = w2.shape[-1]

        dtype = self.request.activation_dtype
        up = weight_config(w13.shape[1], w13.shape[2], dtype, w13.device)
        down = weight_config(w2.shape[1], w2.shape[2], dtype, w2.device)

        def expert_mlp(expert: int, tokens: torch.Tensor) -> torch.Tensor:
            gate_up = invariant_matmul(x[tokens], w13[expert], up)
            h = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).contiguous()
            return invariant_matmul(h, w2[expert], down)

        return combine_experts(x, topk_ids, topk_weights, w2.shape[1], expert_mlp)
