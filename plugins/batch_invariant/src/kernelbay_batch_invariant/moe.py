"""``bi-triton-moe``: unquantized routed experts whose expert GEMMs run on the
batch-invariant matmul (how many tokens reach an expert changes with the batch; a token's
row must not)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, cast

from kernelbay.layers.moe import TorchMoE, combine_experts
from kernelbay.requests import LinearRequest
from kernelbay.verdict import Verdict

if TYPE_CHECKING:
    import torch
    from kernelbay.device import DeviceCapability

    from kernelbay_batch_invariant.configs import MatmulConfig

__all__ = ["BatchInvariantMoE"]


class BatchInvariantMoE(TorchMoE):
    """SwiGLU experts (gather, two invariant GEMMs, weighted scatter-add in expert order)."""

    name: ClassVar[str] = "bi-triton-moe"
    api_version: ClassVar[str] = "1.0"
    # Above torch-moe, which declares invariance but runs cuBLAS on per-expert token counts.
    priority: ClassVar[int] = 1
    batch_invariant: ClassVar[bool] = True
    summary: ClassVar[str] = "unquantized routed experts on the batch-invariant Triton matmul"

    def __init__(self, request: LinearRequest) -> None:
        super().__init__(request)
        self._configs: dict[tuple[int, int], MatmulConfig] = {}

    @classmethod
    def can_implement(cls, request: LinearRequest, device: DeviceCapability) -> Verdict:
        return Verdict.all(
            super().can_implement(request, device),
            Verdict.check(device.platform == "cuda",
                          f"runs Triton on CUDA devices, device platform is "
                          f"{device.platform!r}"),
        )

    def _config(self, weight: torch.Tensor) -> MatmulConfig:
        key = (weight.shape[0], weight.shape[1])
        if key not in self._configs:
            from kernelbay_batch_invariant.configs import device_shared_memory, matmul_config

            self._configs[key] = matmul_config(key[0], key[1], self.request.activation_dtype,
                                               device_shared_memory(weight.device))
        return self._configs[key]

    def apply_moe(self, layer: torch.nn.Module, x: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F

        from kernelbay_batch_invariant.kernels import invariant_matmul

        w13 = cast("torch.Tensor", layer.w13)
        w2 = cast("torch.Tensor", layer.w2)
        inter = w2.shape[-1]

        def expert_mlp(expert: int, tokens: torch.Tensor) -> torch.Tensor:
            gate_up = invariant_matmul(x[tokens], w13[expert], self._config(w13[expert]))
            h = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).contiguous()
            return invariant_matmul(h, w2[expert], self._config(w2[expert]))

        return combine_experts(x, topk_ids, topk_weights, w2.shape[1], expert_mlp)
