"""``bi-triton-moe``: unquantized routed experts whose expert GEMMs run on the
batch-invariant matmul (how many tokens reach an expert changes with the batch; a token's
row must not)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, cast

from kernelbay.layers.moe import TorchMoE, swiglu_experts
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
        from kernelbay_batch_invariant.configs import weight_config
        from kernelbay_batch_invariant.kernels import invariant_matmul

        dtype = self.request.activation_dtype

        def matmul(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            config = weight_config(weight.shape[0], weight.shape[1], dtype, weight.device)
            return invariant_matmul(rows.contiguous(), weight, config)

        return swiglu_experts(x, topk_ids, topk_weights, cast("torch.Tensor", layer.w13),
                              cast("torch.Tensor", layer.w2), matmul)
