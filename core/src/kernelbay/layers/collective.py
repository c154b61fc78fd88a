"""Collectives: all-reduce, all-gather, reduce-scatter and GEMM + all-reduce across TP ranks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from kernelbay.backend import Backend
from kernelbay.kinds import BackendKind
from kernelbay.requests import CollectiveRequest

if TYPE_CHECKING:
    import torch

__all__ = ["Collective"]


class Collective(Backend[CollectiveRequest]):
    """Communication across the ranks of one process group; an instance serves one group.

    ``group`` is a ``torch.distributed`` process group (``None``: the default group).
    """

    kind: ClassVar[BackendKind] = BackendKind.COLLECTIVE

    def __init__(self, request: CollectiveRequest, group: Any = None) -> None:
        self.request = request
        self.group = group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over ranks; returns the result (may reuse ``x``'s storage)."""
        raise NotImplementedError(f"{type(self).__qualname__} does not implement all_reduce")

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim`` in rank order."""
        raise NotImplementedError(f"{type(self).__qualname__} does not implement all_gather")

    def reduce_scatter(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Sum over ranks, then keep this rank's equal slice along ``dim``."""
        raise NotImplementedError(f"{type(self).__qualname__} does not implement "
                                  "reduce_scatter")

    def gemm_all_reduce(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``all_reduce(x @ weight^T)``; fused backends overlap the two."""
        import torch.nn.functional as F

        return self.all_reduce(F.linear(x, weight))
