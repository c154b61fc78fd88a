"""All-reduce over symmetric memory (no multicast needed): PyTorch's one-shot kernel for
small messages (every rank reads every peer's buffer) and two-shot (reduce-scatter then
all-gather through peer loads) for larger ones; NCCL outside the sizes it is used for."""

from __future__ import annotations

import functools
import warnings
from typing import TYPE_CHECKING, Any, ClassVar

from kernelbay.layers.collective import Collective
from kernelbay.requests import CollectiveRequest
from kernelbay.verdict import Verdict

from kernelbay_tp_collectives.checks import peer_checks

if TYPE_CHECKING:
    import torch
    from kernelbay.device import DeviceCapability

    from kernelbay_tp_collectives.buffer import SymmetricBuffer

__all__ = ["DEFAULT_MAX_BYTES", "ONE_SHOT_MAX_BYTES", "SymmMemTwoShotAllReduce", "has_op"]

#: Largest all-reduce that goes through the symmetric buffer; larger ones go to NCCL. On
#: 2 x H200 (bench/results/collectives-2xh200.md) two-shot written back was 1.23x NCCL at
#: 4 MB and 0.99x at 16 MB, so NCCL takes everything above 4 MB.
DEFAULT_MAX_BYTES = 4 * 2**20
#: Messages up to this size use the one-shot kernel (one launch that also copies the input
#: into the buffer), larger ones two-shot. Measured on 2 x H200: one-shot 2.1-2.6x NCCL from
#: 4 KB to 1 MB, slower than two-shot from 4 MB.
ONE_SHOT_MAX_BYTES = 2**20
_OPS = ("all_reduce", "gemm_all_reduce")
#: Element types PyTorch's two-shot kernel is compiled for.
DTYPES = ("bfloat16", "float32")
# Slices handed to the two-shot kernel are padded to this many bytes per rank (vector loads).
_ALIGN_BYTES = 16


@functools.cache
def has_op(name: str) -> bool:
    """True when this torch registers ``torch.ops.symm_mem.<name>``."""
    import torch

    try:
        getattr(torch.ops.symm_mem, name)
    except (AttributeError, RuntimeError):
        return False
    return True


class SymmMemTwoShotAllReduce(Collective):
    """All-reduce through a symmetric staging buffer, for messages up to 4 MB.

    Per call: messages up to ``one_shot_max`` bytes run ``one_shot_all_reduce_copy_out``
    (the copy into the buffer is part of the kernel; the sum lands in a fresh tensor);
    larger ones copy into the buffer and run ``two_shot_all_reduce_out``, which writes the
    sum straight back into ``x`` (no copy back). Inputs larger than ``max_bytes``, of an odd
    byte size, non-contiguous or not bf16/fp32 use NCCL; if the buffer cannot be set up or a
    kernel refuses a call, the instance warns once and uses NCCL from then on.

    With two ranks every path (one-shot, two-shot, NCCL) computes ``a + b`` in one rounding,
    so which path a size takes cannot change a bit; with more ranks the paths may add the
    shards in different orders.
    """

    name: ClassVar[str] = "tp-symm-mem-two-shot"
    api_version: ClassVar[str] = "1.0"
    # Above torch-distributed (0): with the size routing above it was faster than NCCL up to
    # 4 MB on 2 x H200 and hands larger messages to NCCL (bench/results/collectives-2xh200.md;
    # a copy-in/copy-out two-shot for every size, measured first, was slower everywhere).
    priority: ClassVar[int] = 20
    # Every rank sums the peers' shards in rank order, whatever the batch is.
    batch_invariant: ClassVar[bool] = True
    summary: ClassVar[str] = ("one-/two-shot all-reduce over PyTorch symmetric memory (no "
                              "multicast) up to 4 MB, NCCL above")

    def __init__(self, request: CollectiveRequest, group: Any = None,
                 max_bytes: int = DEFAULT_MAX_BYTES,
                 one_shot_max: int = ONE_SHOT_MAX_BYTES) -> None:
        super().__init__(request, group)
        self.max_bytes = max_bytes
        self.one_shot_max = one_shot_max
        self._buffer: SymmetricBuffer | None = None
        self._broken = False
    @classmethod
    def can_implement(cls, request: CollectiveRequest, device: DeviceCapability) -> Verdict:
        return Verdict.all(
            Verdict.handles(request.op in _OPS,
                            f"implements {_OPS}, request asks {request.op!r}"),
            *peer_checks(request, device),
            Verdict.check(request.dtype in DTYPES,
                          f"sums dtypes {DTYPES}, request has {request.dtype!r}"),
        )

    def _staging(self, x: torch.Tensor) -> SymmetricBuffer | None:
        if self._broken:
            return None
        if self._buffer is None:
            try:
                from kernelbay_tp_collectives.buffer import SymmetricBuffer

                self._buffer = SymmetricBuffer(self.max_bytes, x.device, self.group)
            except Exception as exc:  # any set-up failure: NCCL still gives the sum
                self._disable(exc)
                return None
        return self._buffer

    def _disable(self, exc: Exception) -> None:
        self._broken = True
        warnings.warn(f"{self.name}: symmetric memory all-reduce unavailable ({exc}); using "
                      "torch.distributed all_reduce instead", RuntimeWarning, stacklevel=4)

    def path(self, x: torch.Tensor) -> str:
        """Which kernel ``all_reduce(x)`` runs: ``"one_shot"``, ``"two_shot"`` or
        ``"nccl"`` (from the size, dtype, layout and this torch's ops; never from values)."""
        if self._broken or self.request.world_size == 1:
            return "nccl"
        nbytes = x.numel() * x.element_size()
        if not (x.is_cuda and x.is_contiguous() and nbytes % 4 == 0 and nbytes > 0
                and str(x.dtype).removeprefix("torch.") in DTYPES):
            return "nccl"
        if nbytes <= self.one_shot_max and has_op("one_shot_all_reduce_copy_out"):
            return "one_shot"
        return "two_shot" if self._padded(nbytes) <= self.max_bytes else "nccl"

    def _padded(self, nbytes: int) -> int:
        quantum = _ALIGN_BYTES * self.request.world_size
        return -(-nbytes // quantum) * quantum

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        import torch
        import torch.distributed as dist

        path = self.path(x)
        buffer = self._staging(x) if path != "nccl" else None
        if buffer is None:
            if self.request.world_size > 1:
                dist.all_reduce(x, group=self.group)
            return x
        n = x.numel()
        try:
            if path == "one_shot":
                out = torch.empty_like(x)
                torch.ops.symm_mem.one_shot_all_reduce_copy_out(
                    buffer.view(n, x.dtype), x.view(-1), "sum", buffer.group_name,
                    out.view(-1))
                return out
            n_pad = self._padded(n * x.element_size()) // x.element_size()
            staged = buffer.view(n_pad, x.dtype)
            staged[:n].copy_(x.view(-1))
            if n_pad > n:
                # Padding to whole 16-byte vectors per rank: reduce in place, copy back.
                staged[n:].zero_()
                torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", buffer.group_name)
                x.copy_(staged[:n].view(x.shape))
            elif has_op("two_shot_all_reduce_out"):
                torch.ops.symm_mem.two_shot_all_reduce_out(staged, "sum", buffer.group_name,
                                                           x.view(-1))
            else:  # an older torch: reduce in place and copy back
                torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", buffer.group_name)
                x.copy_(staged.view(x.shape))
        except Exception as exc:  # e.g. a world size the kernel was not built for
            self._disable(exc)
            dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_in_buffer(self, numel: int, dtype: torch.dtype,
                             out: torch.Tensor | None = None) -> torch.Tensor:
        """Sum the first ``numel`` elements already written into ``self.buffer(x)`` (a
        producer that writes its output straight into symmetric memory skips the copy in);
        the result goes to ``out`` (or a fresh tensor). Two-shot above ``one_shot_max``
        bytes, one-shot below; ``numel * itemsize`` must be a multiple of 16 x world."""
        import torch

        if self._buffer is None:
            raise RuntimeError(f"{self.name}: all_reduce_in_buffer before the buffer exists; "
                               "call buffer() first")
        nbytes = numel * dtype.itemsize
        if nbytes != self._padded(nbytes) or nbytes > self.max_bytes:
            raise ValueError(f"{self.name}: all_reduce_in_buffer of {nbytes} bytes; valid: "
                             f"a multiple of {_ALIGN_BYTES * self.request.world_size} up to "
                             f"{self.max_bytes}")
        src = self._buffer.view(numel, dtype)
        result = out if out is not None else torch.empty(numel, dtype=dtype,
                                                         device=src.device)
        if nbytes <= self.one_shot_max and has_op("one_shot_all_reduce_out"):
            torch.ops.symm_mem.one_shot_all_reduce_out(src, "sum", self._buffer.group_name,
                                                       result.view(-1))
        else:
            torch.ops.symm_mem.two_shot_all_reduce_out(src, "sum", self._buffer.group_name,
                                                       result.view(-1))
        return result

    def buffer(self, x: torch.Tensor) -> SymmetricBuffer | None:
        """This instance's symmetric buffer (built collectively on first use, on ``x``'s
        device); ``None`` when symmetric memory is unavailable (the instance warned)."""
        return self._staging(x)

    def gemm_all_reduce(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``x @ W^T`` written straight into the symmetric buffer, then summed out of it
        (no staging copy); shapes that do not fit the buffer run GEMM, then ``all_reduce``."""
        import torch
        import torch.nn.functional as F

        m, n = x.shape[0], weight.shape[0]
        nbytes = m * n * x.element_size()
        fits = (self.request.world_size > 1 and x.is_cuda and x.dim() == 2
                and str(x.dtype).removeprefix("torch.") in DTYPES
                and nbytes == self._padded(nbytes) and nbytes <= self.max_bytes)
        buffer = self._staging(x) if fits else None
        if buffer is None:
            return self.all_reduce(F.linear(x, weight))
        torch.mm(x, weight.t(), out=buffer.view(m * n, x.dtype).view(m, n))
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
        try:
            self.all_reduce_in_buffer(m * n, x.dtype, out.view(-1))
        except Exception as exc:
            self._disable(exc)
            return self.all_reduce(F.linear(x, weight))
        return out
