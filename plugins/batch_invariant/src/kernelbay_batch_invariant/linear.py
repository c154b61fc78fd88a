"""``bi-triton-linear``: unquantized linear layers on the batch-invariant Triton matmul."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, cast

from kernelbay.layers.torch_linear import TorchUnquantizedLinear
from kernelbay.requests import LinearRequest
from kernelbay.verdict import Verdict

from kernelbay_batch_invariant.checks import runs_on_cuda

if TYPE_CHECKING:
    import torch
    from kernelbay.device import DeviceCapability

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

    @classmethod
    def can_implement(cls, request: LinearRequest, device: DeviceCapability) -> Verdict:
        # the reference's own checks (unquantized, dense, float activations), then the device
        return Verdict.all(super().can_implement(request, device), runs_on_cuda(device))

    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        from kernelbay_batch_invariant.configs import weight_config
        from kernelbay_batch_invariant.kernels import invariant_matmul

        weight = cast("torch.Tensor", layer.weight)
        config = weight_config(weight.shape[0], weight.shape[1], self.request.activation_dtype,
                               weight.device)
        y = invariant_matmul(x.reshape(-1, x.shape[-1]), weight, config)
        bias = self.rank_bias(layer)
        if bias is not None:
            y = y + bias  # elementwise: the same for every row count
        return y.reshape(*x.shape[:-1], y.shape[-1])
