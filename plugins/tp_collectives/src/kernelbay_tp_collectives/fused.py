"""GEMM + all-reduce fused through a multicast symmetric buffer: the GEMM writes straight
into symmetric memory and a multimem all-reduce sums it in place.

Only where multicast (NVLS) works: ``can_implement`` rejects otherwise, and the multicast
switches of the environment count as "off". If set-up still fails, the instance warns once
and runs GEMM, then all-reduce.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, ClassVar

from kernelbay.layers.collective import Collective
from kernelbay.requests import CollectiveRequest
from kernelbay.verdict import Verdict

from kernelbay_tp_collectives.checks import multicast_switched_off, peer_checks

if TYPE_CHECKING:
    import torch
    from kernelbay.device import DeviceCapability

    from kernelbay_tp_collectives.buffer import SymmetricBuffer

__all__ = ["FusedGemmAllReduce"]

_MAX_BYTES = 64 * 2**20


class FusedGemmAllReduce(Collective):
    """``all_reduce(x @ W^T)`` with the GEMM output in a multicast symmetric buffer."""

    name: ClassVar[str] = "tp-fused-gemm-all-reduce"
    api_version: ClassVar[str] = "1.0"
    priority: ClassVar[int] = 30
    summary: ClassVar[str] = "GEMM into symmetric memory + multimem all-reduce (needs multicast)"
    #: The engine may hand this collective a row-parallel layer's GEMM.
    fuses_gemm: ClassVar[bool] = True

    def __init__(self, request: CollectiveRequest, group: Any = None,
                 max_bytes: int = _MAX_BYTES) -> None:
        super().__init__(request, group)
        self.max_bytes = max_bytes
        self._buffer: SymmetricBuffer | None = None
        self._fallback = False

    @classmethod
    def can_implement(cls, request: CollectiveRequest, device: DeviceCapability) -> Verdict:
        switches = multicast_switched_off()
        return Verdict.all(
            Verdict.handles(request.op == "gemm_all_reduce",
                            f"implements gemm_all_reduce only, request asks {request.op!r}"),
            *peer_checks(request, device),
            Verdict.check(device.multicast is True,
                          "needs multicast (NVLS) between the devices, device "
                          f"{device.arch!r} reports multicast={device.multicast}"),
            Verdict.check(not switches,
                          f"needs multicast, which this environment switches off "
                          f"({', '.join(switches)})"),
        )

    @property
    def fell_back(self) -> bool:
        """True once set-up failed and the instance runs GEMM, then all-reduce."""
        return self._fallback

    def _fall_back(self, why: str) -> None:
        self._fallback = True
        warnings.warn(f"{self.name}: fused GEMM + all-reduce unavailable ({why}); running "
                      "GEMM, then all-reduce", RuntimeWarning, stacklevel=4)

    def _multicast_buffer(self, x: torch.Tensor) -> SymmetricBuffer | None:
        if self._fallback:
            return None
        if self._buffer is None:
            switches = multicast_switched_off()
            if switches:  # never touch multicast on a host that switched it off
                self._fall_back(f"multicast switched off by {', '.join(switches)}")
                return None
            try:
                if not x.is_cuda:
                    raise RuntimeError(f"symmetric memory needs CUDA tensors, got {x.device}")
                from kernelbay_tp_collectives.buffer import SymmetricBuffer

                buffer = SymmetricBuffer(self.max_bytes, x.device, self.group)
                if not buffer.has_multicast:
                    raise RuntimeError("the symmetric buffer has no multicast address")
                self._buffer = buffer
            except Exception as exc:
                self._fall_back(str(exc))
                return None
        return self._buffer

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        if self.request.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gemm_all_reduce(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        import torch

        m, n = x.shape[0], weight.shape[0]
        nbytes = m * n * x.element_size()
        buffer = (self._multicast_buffer(x)
                  if self.request.world_size > 1 and nbytes % 16 == 0
                  and nbytes <= self.max_bytes else None)
        if buffer is None:
            return self.all_reduce(torch.nn.functional.linear(x, weight))
        out = buffer.view(m * n, x.dtype).view(m, n)
        torch.mm(x, weight.t(), out=out)
        try:
            torch.ops.symm_mem.multimem_all_reduce_(out, "sum", buffer.group_name)
        except Exception as exc:  # the kernel refused (dtype, alignment): fall back for good
            self._fall_back(str(exc))
            return self.all_reduce(out.clone())
        return out.clone()
