"""The paged KV cache: one page pool shared by every attention layer, sized from the
backends' record layouts, and an allocator of pages to sequences."""

from __future__ import annotations

from dataclasses import dataclass
from typing import final

import torch

from kernelbay.engine.modules import AttentionLayer

__all__ = ["KVCacheConfig", "PageAllocator", "PagedKVCache", "pages_for"]


@final
@dataclass(frozen=True)
class KVCacheConfig:
    """The KV cache a model runs with.

    ``record`` is ``"auto"`` (the model dtype) or a record kind an attention backend stores
    (``"bf16"``, ``"fp8"``, ``"mxfp8"`` ...). ``memory`` is a byte budget (> 1) or a fraction
    of the device's memory (0 < memory <= 1); ``None`` sizes the cache for the engine's
    ``max_num_seqs`` sequences of ``max_model_len`` tokens. The pool has one page more than
    sequences can own (``PagedKVCache.scratch_page``, for padded CUDA-graph steps), which a
    memory budget includes.
    """

    record: str = "auto"
    memory: float | None = None
    page_size: int = 16

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.memory is not None and self.memory <= 0:
            raise ValueError(f"memory must be a byte count or a fraction in (0, 1], got "
                             f"{self.memory}")


def pages_for(tokens: int, page_size: int) -> int:
    """Pages needed to hold ``tokens`` tokens."""
    return -(-tokens // page_size)


class PageAllocator:
    """Hands out page ids; a sequence owns its pages until it finishes."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def free_pages(self) -> int:
        """Pages not owned by any sequence."""
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        """``count`` free pages; ``MemoryError`` if there are fewer."""
        if count > len(self._free):
            raise MemoryError(f"the KV cache has {len(self._free)} free pages, "
                              f"{count} are needed")
        pages = [self._free.pop() for _ in range(count)]
        return pages

    def free(self, pages: list[int]) -> None:
        """Return pages to the pool."""
        self._free.extend(reversed(pages))


class PagedKVCache:
    """Per-layer page tensors (one layout per layer, one page id space for all)."""

    def __init__(self, layers: list[AttentionLayer], num_pages: int,
                 device: torch.device) -> None:
        if num_pages < 1:
            raise MemoryError("the KV cache budget holds no page (past the one kept as the "
                              "CUDA graphs' scratch page); raise the memory budget")
        self.page_size = layers[0].backend.request.page_size if layers else 16
        # one page more than the allocator hands out: the scratch page
        self.caches = [layer.backend.allocate_cache(num_pages + 1, device) for layer in layers]
        self.allocator = PageAllocator(num_pages)
        #: A page no sequence owns, past the allocator's ids: the pad rows of a decode step
        #: run in a larger CUDA graph (``DecodeGraphs``) write and read only this one.
        self.scratch_page = num_pages
        self.page_bytes = sum(layer.backend.kv_layout().page_bytes for layer in layers)

    @staticmethod
    def bytes_per_page(layers: list[AttentionLayer]) -> int:
        """Bytes one page id costs across every layer (from the backends' layouts)."""
        return sum(layer.backend.kv_layout().page_bytes for layer in layers)
