"""Linear methods: create a layer's parameters, finish them after loading, compute y = x W^T + b."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, final

from kernelbay.backend import Backend
from kernelbay.kinds import BackendKind
from kernelbay.requests import LinearRequest

if TYPE_CHECKING:
    import torch

__all__ = ["LinearMethod", "TensorSpec"]


@final
@dataclass(frozen=True)
class TensorSpec:
    """A tensor a layer expects from the checkpoint: this rank's shape and its dtype name.

    ``shard_dim`` is the dimension split across tensor-parallel ranks (``None``: every rank
    holds the whole tensor).
    """

    shape: tuple[int, ...]
    dtype: str
    shard_dim: int | None = None
    required: bool = True


class LinearMethod(Backend[LinearRequest]):
    """One way to compute a linear layer. An instance serves one layer's request.

    The loader calls ``tensor_specs`` (what to read and validate), ``create_weights``,
    streams tensors into the parameters, then ``process_weights_after_loading`` (repack,
    transpose, pad, fold scales), after which ``apply`` runs.
    """

    kind: ClassVar[BackendKind] = BackendKind.LINEAR

    def __init__(self, request: LinearRequest) -> None:
        self.request = request

    @property
    def weight_shard_dim(self) -> int | None:
        """Dimension of the [N, K] weight split across ranks: 0 column-, 1 row-parallel."""
        return {"column": 0, "row": 1}.get(self.request.parallel)

    def bias_specs(self) -> dict[str, TensorSpec]:
        """``{"bias": spec}`` when the layer has a bias (split with N when column-parallel)."""
        r = self.request
        if not r.bias:
            return {}
        return {"bias": TensorSpec((r.out_features,), r.activation_dtype,
                                   0 if r.parallel == "column" else None)}

    def rank_bias(self, layer: torch.nn.Module) -> torch.Tensor | None:
        """The bias this rank adds. Row-parallel partial sums are all-reduced afterwards, so
        only rank 0 adds the bias."""
        if self.request.parallel == "row" and self.request.tp_rank != 0:
            return None
        bias: torch.Tensor | None = getattr(layer, "bias", None)
        return bias

    def tensor_specs(self) -> Mapping[str, TensorSpec]:
        """Tensors this method reads, by name relative to the layer (``weight``, ``bias`` ...)."""
        raise NotImplementedError(f"{type(self).__qualname__} does not implement tensor_specs")

    def create_weights(self, layer: torch.nn.Module, device: torch.device | str = "cpu") -> None:
        """Register one empty parameter per tensor spec on ``layer``."""
        import torch

        for name, spec in self.tensor_specs().items():
            tensor = torch.empty(spec.shape, dtype=getattr(torch, spec.dtype), device=device)
            layer.register_parameter(name, torch.nn.Parameter(tensor, requires_grad=False))

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Canonicalise loaded tensors into the layout ``apply`` wants (default: nothing)."""
        del layer

    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Compute ``x @ W^T (+ bias)`` with ``x`` of shape [..., K]."""
        raise NotImplementedError(f"{type(self).__qualname__} does not implement apply")

    def dequantized_weight(self, layer: torch.nn.Module) -> torch.Tensor:
        """This rank's weight as a dense [N, K] tensor in the activation dtype (after
        ``process_weights_after_loading``).

        For models that fold a layer's weight into other math instead of calling ``apply``
        (MLA absorbs ``kv_b_proj`` into the query and the output). The default recovers it
        from the method itself, ``W^T = apply(I) - apply(0)``: exact for a layer without
        bias (products by one and zero are exact), within rounding of ``|w| + |b|`` with one;
        methods that hold a dense copy return it directly.
        """
        import torch

        k = self.request.in_features
        param = next(layer.parameters())
        dtype = getattr(torch, self.request.activation_dtype)
        eye = torch.eye(k, dtype=dtype, device=param.device)
        with torch.no_grad():
            columns = self.apply(layer, eye) - self.apply(layer, eye[:1] * 0)
        return columns.t().contiguous()
