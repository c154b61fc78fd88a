"""One symmetric-memory buffer per collective instance, rendezvoused with its group."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["SymmetricBuffer"]


class SymmetricBuffer:
    """A flat buffer of ``max_bytes`` in symmetric memory, visible to every rank of
    ``group``; ``view(n, dtype)`` is its first ``n`` elements.

    Building one is collective: every rank of the group must build it at the same call.
    """

    def __init__(self, max_bytes: int, device: torch.device, group: Any = None) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.group = group if group is not None else dist.group.WORLD
        if self.group is None:
            raise RuntimeError("SymmetricBuffer: torch.distributed is not initialized (no "
                               "process group given and no default group)")
        self.group_name: str = self.group.group_name
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # needed by older torch, a no-op (or absent) in newer
            enable(self.group_name)
        self.raw = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        self.handle = symm_mem.rendezvous(self.raw, self.group_name)
        self.max_bytes = max_bytes

    @property
    def has_multicast(self) -> bool:
        """True when the driver mapped a multicast address for this buffer."""
        return bool(getattr(self.handle, "multicast_ptr", 0))

    def view(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The first ``numel`` elements of ``dtype`` (fits when ``numel * itemsize <=
        max_bytes``)."""
        return self.raw[: numel * dtype.itemsize].view(dtype)
