"""``bi-triton-linear``: unquantized linear layers on the batch-invariant Triton matmul."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, cast

from kernelbay.layers.torch_linear import TorchUnquantizedLinear
from kernelbay.requests import LinearRequest
from kernelbay.verdict import Verdict

if TYPE_CHECKING:
    import torch
    from kernelbay.device import DeviceCapability

    from kernelbay_batch_invariant.configs import MatmulConfig

__all__ = ["BatchInvariantLinear"]


class BatchInvariantLinear(TorchUnquantizedLinear):
    """``y = x W^T (+ b)`` whose rows do not depend on how many rows the batch has: the
    tiling comes from (N, K, dtype) and the device's shared memory, never from M, and K is
    walked in one fixed order (no split-K). Same weights as ``torch-unquantized``."""

    name: ClassVar[str] = "bi-triton-linear"
    api_version: ClassVar[str] = "1.0"
    # Below torch-unquantized: chosen when batch-invariant mode puts invariant methods first.
    priority: ClassVar[int] = -5
    batch_invariant: ClassVar[bool] = True
    summary: ClassVar[str] = "batch-invariant Triton matmul, unquantized bf16/fp16/fp32, CUDA"

    def __init__(self, request: LinearRequest) -> None:
        super().__init__(request)
        self._config: MatmulConfig | None = None

    @classmethod
    def can_implement(cls, request: LinearRequest, device: DeviceCapability) -> Verdict:
        # the reference's own checks (unquantized, dense, float activations), then the device
        return Verdict.all(
            super().can_implement(request, device),
            Verdict.check(device.platform == "cuda",
                          f"runs Triton on CUDA devices, device platform is "
                          f"{device.platform!r}"),
        )

    def config(self, device: torch.device) -> MatmulConfig:
        """This layer's tiling on ``device`` (computed once)."""
        if self._config is None:
            from kernelbay_batch_invariant.configs import device_shared_memory, matmul_config

            r = self.request
            self._config = matmul_config(r.out_features, r.in_features, r.activation_dtype,
                                         device_shared_memory(device))
        return self._config

    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        from kernelbay_batch_invariant.kernels import invariant_matmul

        weight = cast("torch.Tensor", layer.weight)
        y = invariant_matmul(x.reshape(-1, x.shape[-1]), weight, self.config(weight.device))
        bias = self.rank_bias(layer)
        if bias is not None:
            y = y + bias  # elementwise: the same for every row count
        return y.reshape(*x.shape[:-1], y.shape[-1])
