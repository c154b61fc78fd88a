"""Attention backends: the KV-cache record layout, writing K/V into pages, and attention."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, final

from kernelbay.backend import Backend
from kernelbay.kinds import BackendKind
from kernelbay.requests import AttentionRequest

if TYPE_CHECKING:
    import torch

__all__ = ["AttentionBackend", "AttentionMetadata", "KVCacheLayout", "visible_keys"]


@final
@dataclass(frozen=True)
class KVCacheLayout:
    """What one token of one layer occupies in the paged cache, and how pages align.

    The engine sizes the cache from this, never from literals: ``page_bytes`` is the page
    stride, rounded up to ``alignment`` bytes.
    """

    bytes_per_token: int
    page_size: int
    alignment: int = 256
    record: str = ""

    @property
    def page_bytes(self) -> int:
        """Bytes per page of one layer, rounded up to the alignment."""
        raw = self.bytes_per_token * self.page_size
        return -(-raw // self.alignment) * self.alignment

    def pages_for(self, budget_bytes: int, num_layers: int) -> int:
        """How many pages fit in ``budget_bytes`` when every one of ``num_layers`` layers has one."""
        return max(0, budget_bytes // (self.page_bytes * max(1, num_layers)))


@dataclass
class AttentionMetadata:
    """Where a batch's tokens live in the paged cache (torch tensors on the compute device).

    ``query_start_loc`` [B+1] cumulative new-token counts; ``seq_lens`` [B] context length
    after this step (new tokens included); ``block_tables`` [B, max_pages] page ids;
    ``slot_mapping`` [T] ``page * page_size + offset`` of each new token.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    #: ``query_start_loc`` and ``seq_lens`` as host ints, when the caller has them (the
    #: engine builds them there): a backend that needs host values (a loop over sequences,
    #: a padded length) reads these instead of copying from the device, which waits for
    #: every kernel queued before. ``None``: not given (``host_query_starts`` and
    #: ``host_seq_lens`` then copy).
    query_start_host: tuple[int, ...] | None = None
    seq_lens_host: tuple[int, ...] | None = None
    #: A bound on ``seq_lens`` known on the host, for a backend that pads keys to one length:
    #: the engine gives the longest context, or inside a CUDA graph (where ``seq_lens_host``
    #: is ``None``: the lengths change at every replay) the block tables' capacity. Keys past
    #: a sequence's length are masked, so the result does not depend on the bound beyond
    #: rounding. ``None``: not given (``max(host_seq_lens())``).
    max_seq_len: int | None = None

    def host_query_starts(self) -> list[int]:
        """``query_start_loc`` on the host: the caller's copy, else read from the tensor."""
        if self.query_start_host is not None:
            return list(self.query_start_host)
        return list(self.query_start_loc.tolist())

    def seq_len_bound(self) -> int:
        """``max_seq_len`` when given, else the longest context (``host_seq_lens``)."""
        if self.max_seq_len is not None:
            return self.max_seq_len
        return max(self.host_seq_lens(), default=0)

    def host_seq_lens(self) -> list[int]:
        """``seq_lens`` on the host: the caller's copy, else read from the tensor."""
        if self.seq_lens_host is not None:
            return list(self.seq_lens_host)
        return list(self.seq_lens.tolist())

    def padded_key_pages(self, page_size: int) -> tuple[int, torch.Tensor]:
        """``(context, pages)`` for attending the batch with keys padded to one length:
        ``seq_len_bound()`` within the tables' capacity, and the page ids [B, P] (int64) of
        each sequence's first ``context`` keys. Keys past a sequence's length are the
        caller's to mask (``visible_keys``)."""
        context = min(self.seq_len_bound(), self.block_tables.shape[1] * page_size)
        return context, self.block_tables[:, :-(-context // page_size)].long()


def visible_keys(q_pos: torch.Tensor, context: int,
                 sliding_window: int | None = None) -> torch.Tensor:
    """Which of keys ``0 .. context - 1`` a query at position ``q_pos`` (a tensor of any
    shape) attends to: bool ``[*q_pos.shape, context]``, key ``j`` when ``j <= q_pos``
    (causal) and, with a sliding window, ``j > q_pos - sliding_window``. A decode step's
    query sits at ``seq_len - 1``, so padded keys past its length are masked too."""
    import torch

    keys = torch.arange(context, device=q_pos.device)
    allowed = keys <= q_pos[..., None]
    if sliding_window is not None:
        allowed &= keys > q_pos[..., None] - sliding_window
    return allowed


class AttentionBackend(Backend[AttentionRequest]):
    """One way to store K/V in pages and attend over them; an instance serves one layer kind."""

    kind: ClassVar[BackendKind] = BackendKind.ATTENTION

    def __init__(self, request: AttentionRequest) -> None:
        self.request = request

    def kv_layout(self) -> KVCacheLayout:
        """The record layout of one token of one layer."""
        raise NotImplementedError(f"{type(self).__qualname__} does not implement kv_layout")

    def allocate_cache(self, num_pages: int, device: torch.device | str) -> torch.Tensor:
        """An empty cache of ``num_pages`` pages for one layer."""
        raise NotImplementedError(f"{type(self).__qualname__} does not implement allocate_cache")

    def write_kv(self, cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None,
                 slot_mapping: torch.Tensor) -> None:
        """Store the new tokens' keys and values (for MLA: the latent, ``value`` None)."""
        raise NotImplementedError(f"{type(self).__qualname__} does not implement write_kv")

    def forward(self, query: torch.Tensor, cache: torch.Tensor, metadata: AttentionMetadata,
                scale: float) -> torch.Tensor:
        """Causal attention of the new queries [T, H, D] over each sequence's cached context."""
        raise NotImplementedError(f"{type(self).__qualname__} does not implement forward")
