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

__all__ = ["upload", "upload_into"]


def _staged(values: Sequence[Any], dtype: torch.dtype, cuda: bool) -> torch.Tensor:
    """``values`` as a host tensor, in pinned memory when it goes to a CUDA device."""
    host = torch.tensor(values, dtype=dtype)
    return host.pin_memory() if cuda else host


def upload(values: Sequence[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` on ``device``; on a CUDA device the copy is
    asynchronous (pinned staging buffer, ``non_blocking``)."""
    cuda = device.type == "cuda"
    return _staged(values, dtype, cuda).to(device, non_blocking=cuda)


def upload_into(buffer: torch.Tensor, values: Sequence[Any]) -> None:
    """``values`` into the existing ``buffer`` (its dtype and shape), asynchronously into a
    CUDA buffer, as ``upload`` copies."""
    buffer.copy_(_staged(values, buffer.dtype, buffer.is_cuda), non_blocking=buffer.is_cuda)
