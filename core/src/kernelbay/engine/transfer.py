"""Host values to the device without waiting for it.

A plain ``torch.tensor(values, device="cuda")`` copies from pageable memory and synchronizes
the stream, so every small table the engine builds per step would wait for all the kernels
queued before it, and the host could never run ahead of the GPU. Staged through pinned
memory, the copy is queued like a kernel (the caching host allocator keeps the staging buffer
until the copy has run)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["upload"]


def upload(values: Sequence[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` on ``device``; on a CUDA device the copy is
    asynchronous (pinned staging buffer, ``non_blocking``)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
