"""The always-available paged attention for MHA/GQA/MQA, in plain torch."""

from __future__ import annotations

from itertools import pairwise
from typing import TYPE_CHECKING, ClassVar

from kernelbay._version import PLUGIN_API_VERSION
from kernelbay.layers.attention import (
    AttentionBackend,
    AttentionMetadata,
    KVCacheLayout,
    visible_keys,
)
from kernelbay.requests import AttentionRequest
from kernelbay.verdict import Verdict

if TYPE_CHECKING:
    import torch

    from kernelbay.device import DeviceCapability

__all__ = ["TorchPagedAttention"]

# Record kinds this backend stores, by name, with the torch dtype and its size in bytes.
_RECORDS = {"bf16": ("bfloat16", 2), "fp16": ("float16", 2), "fp32": ("float32", 4)}
_DTYPE_RECORD = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def _record(request: AttentionRequest) -> str:
    return _DTYPE_RECORD.get(request.dtype, "?") if request.kv_cache == "auto" else request.kv_cache


class TorchPagedAttention(AttentionBackend):
    """Paged causal attention in plain torch: K and V pages, fp32 softmax, any device.

    Cache layout per layer: ``[num_pages, 2, page_size, num_kv_heads, head_dim]``.
    """

    name: ClassVar[str] = "torch-paged"
    api_version: ClassVar[str] = PLUGIN_API_VERSION
    priority: ClassVar[int] = 0
    # Decode batches pad keys to the longest context: the reduction order can depend on it.
    batch_invariant: ClassVar[bool] = False
    summary: ClassVar[str] = "MHA/GQA/MQA paged attention in plain torch, any device"

    @classmethod
    def can_implement(cls, request: AttentionRequest, device: DeviceCapability) -> Verdict:
        r = request
        return Verdict.all(
            Verdict.handles(r.attention in ("mha", "gqa", "mqa"),
                          f"implements mha/gqa/mqa, request is {r.attention!r}"),
            Verdict.check(_record(r) in _RECORDS,
                          f"stores K/V records {sorted(_RECORDS)} only, request asks "
                          f"{r.kv_cache!r} with dtype {r.dtype!r}"),
            Verdict.check(r.num_kv_heads > 0 and r.num_heads % r.num_kv_heads == 0,
                          f"needs num_heads a multiple of num_kv_heads, got {r.num_heads} "
                          f"and {r.num_kv_heads}"),
            Verdict.check(r.v_head_dim in (None, r.head_dim),
                          f"needs v_head_dim == head_dim, got {r.v_head_dim} and {r.head_dim}"),
            Verdict.check(r.sparse_topk is None,
                          f"has no sparse top-k attention, request asks top-{r.sparse_topk}"),
        )

    def kv_layout(self) -> KVCacheLayout:
        r = self.request
        record = _record(r)
        itemsize = _RECORDS[record][1]
        return KVCacheLayout(2 * r.num_kv_heads * r.head_dim * itemsize, r.page_size,
                             record=record)

    def allocate_cache(self, num_pages: int, device: torch.device | str) -> torch.Tensor:
        import torch

        r = self.request
        dtype = getattr(torch, _RECORDS[_record(r)][0])
        return torch.zeros((num_pages, 2, r.page_size, r.num_kv_heads, r.head_dim),
                           dtype=dtype, device=device)

    def write_kv(self, cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None,
                 slot_mapping: torch.Tensor) -> None:
        if value is None:
            raise ValueError(f"{self.name}: write_kv needs a value tensor for "
                             f"{self.request.attention!r} attention")
        page_size = self.request.page_size
        pages = slot_mapping // page_size
        offsets = slot_mapping % page_size
        cache[pages, 0, offsets] = key.to(cache.dtype)
        cache[pages, 1, offsets] = value.to(cache.dtype)

    def forward(self, query: torch.Tensor, cache: torch.Tensor, metadata: AttentionMetadata,
                scale: float) -> torch.Tensor:
        starts = metadata.host_query_starts()
        if len(starts) > 1 and all(b - a == 1 for a, b in pairwise(starts)):
            return self._decode(query, cache, metadata, scale)
        return self._varlen(query, cache, metadata, scale, starts)

    def _decode(self, query: torch.Tensor, cache: torch.Tensor, metadata: AttentionMetadata,
                scale: float) -> torch.Tensor:
        """One new token per sequence: the whole batch at once, keys padded to the longest
        context and masked (GQA by grouping the queries, so K/V are never repeated)."""
        import torch

        r = self.request
        batch, group = query.shape[0], r.num_heads // r.num_kv_heads
        lengths = metadata.seq_lens.long()
        context, pages = metadata.padded_key_pages(r.page_size)
        kv = cache[pages].float()                                 # [B, P, 2, S, Hkv, D]
        k = kv[:, :, 0].reshape(batch, -1, r.num_kv_heads, r.head_dim)[:, :context]
        v = kv[:, :, 1].reshape(batch, -1, r.num_kv_heads, r.head_dim)[:, :context]
        q = query.float().view(batch, r.num_kv_heads, group, r.head_dim)
        scores = torch.einsum("bkgd,bckd->bkgc", q, k) * scale    # [B, Hkv, G, C]
        allowed = visible_keys(lengths - 1, context, r.sliding_window)   # [B, C]
        scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("bkgc,bckd->bkgd", probs, v)
        return out.reshape(batch, r.num_heads, r.head_dim).to(query.dtype)

    def _varlen(self, query: torch.Tensor, cache: torch.Tensor, metadata: AttentionMetadata,
                scale: float, starts: list[int]) -> torch.Tensor:
        """Any mix of prefill and decode: sequences in groups, each group at once with its
        queries padded to its most new tokens and its keys to its longest context (masked),
        a group as large as keeps its float32 working memory within ``VARLEN_GROUP_BYTES``."""
        import torch

        r = self.request
        out = torch.empty_like(query)
        lengths = metadata.host_seq_lens()
        counts = [b - a for a, b in pairwise(starts)]
        qsl = seq_of = None
        for first, last in _groups(counts, lengths, r.num_heads,
                                   2 * r.num_kv_heads * r.head_dim):
            lo, hi = starts[first], starts[last]
            if lo == hi:
                continue
            if last - first == 1:  # nothing to pad
                out[lo:hi] = self._one(query[lo:hi], cache, metadata, scale, first,
                                       lengths[first])
                continue
            if qsl is None or seq_of is None:  # each query token's sequence, on the device
                qsl = metadata.query_start_loc.long()
                seq_of = torch.repeat_interleave(torch.arange(len(counts), device=query.device),
                                                 qsl[1:] - qsl[:-1], output_size=starts[-1])
            out[lo:hi] = self._group(query[lo:hi], cache, metadata, scale,
                                     seq_of[lo:hi] - first, qsl[first:last + 1] - lo,
                                     range(first, last), max(counts[first:last]),
                                     max(lengths[first:last]))
        return out

    def _one(self, query: torch.Tensor, cache: torch.Tensor, metadata: AttentionMetadata,
             scale: float, seq: int, context: int) -> torch.Tensor:
        """Attention of the new tokens of sequence ``seq`` ([L, H, D]) over its ``context``
        keys, in float32."""
        import torch

        r = self.request
        num_new, group = query.shape[0], r.num_heads // r.num_kv_heads
        q = query.float().view(num_new, r.num_kv_heads, group, r.head_dim)
        pages = metadata.block_tables[seq, :-(-context // r.page_size)].long()
        kv = cache[pages].float()                                 # [P, 2, S, Hkv, D]
        k = kv[:, 0].reshape(-1, r.num_kv_heads, r.head_dim)[:context]
        v = kv[:, 1].reshape(-1, r.num_kv_heads, r.head_dim)[:context]
        scores = torch.einsum("lkgd,ckd->kglc", q, k) * scale     # [Hkv, G, L, C]
        allowed = visible_keys(torch.arange(context - num_new, context, device=q.device),
                               context, r.sliding_window)          # [L, C]
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        o = torch.einsum("kglc,ckd->lkgd", probs, v)
        return o.reshape(num_new, r.num_heads, r.head_dim).to(query.dtype)

    def _group(self, query: torch.Tensor, cache: torch.Tensor, metadata: AttentionMetadata,
               scale: float, seq_of: torch.Tensor, qsl: torch.Tensor, seqs: range,
               width: int, context: int) -> torch.Tensor:
        """Attention of the query tokens of sequences ``seqs`` ([T, H, D], ``seq_of`` each
        token's sequence within the group, ``qsl`` the group's query starts from 0): padded
        to ``width`` queries and ``context`` keys per sequence, masked, in float32."""
        import torch

        r = self.request
        group = r.num_heads // r.num_kv_heads
        batch, dev = len(seqs), query.device
        within = torch.arange(query.shape[0], device=dev) - qsl[seq_of]   # [T]
        # row i of sequence b is token qsl[b] + i; past its count, any token (masked out)
        rows = (qsl[:-1, None] + torch.arange(width, device=dev)).clamp(max=query.shape[0] - 1)
        q = query.float()[rows].view(batch, width, r.num_kv_heads, group, r.head_dim)
        pages = metadata.block_tables[seqs.start:seqs.stop, :-(-context // r.page_size)].long()
        kv = cache[pages].float()                                 # [B, P, 2, S, Hkv, D]
        k = kv[:, :, 0].reshape(batch, -1, r.num_kv_heads, r.head_dim)[:, :context]
        v = kv[:, :, 1].reshape(batch, -1, r.num_kv_heads, r.head_dim)[:, :context]
        scores = torch.einsum("blkgd,bckd->bkglc", q, k) * scale  # [B, Hkv, G, L, C]
        lengths = metadata.seq_lens[seqs.start:seqs.stop].long()
        first_new = lengths - (qsl[1:] - qsl[:-1])                # position of query 0
        q_pos = first_new[:, None] + torch.arange(width, device=dev)[None, :]     # [B, L]
        allowed = visible_keys(q_pos, context, r.sliding_window)  # [B, L, C]
        scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
        # padding query rows may have no key at all: their NaNs are never read back
        probs = torch.softmax(scores, dim=-1)
        o = torch.einsum("bkglc,bckd->blkgd", probs, v)           # [B, L, Hkv, G, D]
        return o.reshape(batch, width, r.num_heads, r.head_dim)[seq_of, within].to(query.dtype)


#: The float32 working memory one group of ``_varlen`` may take: sequences are attended
#: together while their padded scores (three copies: scores, masked, probabilities) and their
#: keys and values read from the pages fit.
VARLEN_GROUP_BYTES = 256 << 20


def _groups(counts: list[int], lengths: list[int], heads: int,
            kv_row_floats: int) -> list[tuple[int, int]]:
    """Consecutive runs ``[first, last)`` of sequences attended at once, each run's float32
    working memory (per sequence: 3 x heads x its most new tokens x its longest context
    scores, plus 2 x ``kv_row_floats`` per key of keys and values) within
    ``VARLEN_GROUP_BYTES``, at least one sequence per run. Sequences without new tokens are
    in no run (they would only widen one)."""
    runs: list[tuple[int, int]] = []
    first, width, context = 0, 0, 0

    def size(n: int, w: int, c: int) -> int:
        return n * 4 * (3 * heads * w * c + 2 * kv_row_floats * c)

    for b, (count, length) in enumerate(zip(counts, lengths, strict=True)):
        if count == 0:
            if b > first:
                runs.append((first, b))
            first, width, context = b + 1, 0, 0
            continue
        w, c = max(width, count), max(context, length)
        if b > first and size(b - first + 1, w, c) > VARLEN_GROUP_BYTES:
            runs.append((first, b))
            first, w, c = b, count, length
        width, context = w, c
    if first < len(counts):
        runs.append((first, len(counts)))
    return runs
