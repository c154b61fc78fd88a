"""The ``mla-reference`` attention backend: absorbed MLA over paged records, plain torch.

This module imports no torch at module level (discovery imports it); the math lives in
``mla`` and ``codec``, imported when the backend runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from kernelbay.layers import AttentionBackend, AttentionMetadata, KVCacheLayout
from kernelbay.requests import AttentionRequest
from kernelbay.verdict import Verdict

from kernelbay_attn_flashmla.records import RECORDS, MLARecord, record_for_dims

if TYPE_CHECKING:
    import torch
    from kernelbay.device import DeviceCapability

__all__ = ["QUERY_DTYPES", "MLAReferenceAttention", "record_for"]

#: Query/output dtypes the reference computes for (it works in float32 internally).
QUERY_DTYPES = ("bfloat16", "float16", "float32")
# kv_cache "auto" means records in the request's dtype; only bf16 has an MLA record.
_AUTO = {"bfloat16": "bf16"}


def record_for(request: AttentionRequest) -> MLARecord | str:
    """The record kind a request asks for, laid out for the request's latent dims
    (``records.record_for_dims``), or a sentence saying why there is none."""
    kv = request.kv_cache
    if kv == "auto":
        if request.dtype not in _AUTO:
            return (f"kv_cache 'auto' means {request.dtype!r} records, and MLA records come in "
                    f"{sorted(RECORDS)} ('auto' only with dtype 'bfloat16')")
        kv = _AUTO[request.dtype]
    if kv not in RECORDS:
        return (f"stores MLA records {sorted(RECORDS)} (or 'auto' with dtype 'bfloat16'), "
                f"request asks {kv!r}")
    if request.kv_lora_rank is None or request.rope_dim is None:
        return (f"needs kv_lora_rank and rope_dim for MLA, request has "
                f"kv_lora_rank={request.kv_lora_rank}, rope_dim={request.rope_dim}")
    try:
        return record_for_dims(kv, request.kv_lora_rank, request.rope_dim)
    except ValueError as exc:
        return str(exc)


class MLAReferenceAttention(AttentionBackend):
    """Absorbed MLA attention over paged compact records (bf16, fp8 + fp32 scales, fp8 + E8M0
    scales, MXFP8), in plain torch on any device: the reference faster kernels are tested
    against.

    Query layout: ``[T, H, kv_lora_rank + rope_dim]``, the nope part already multiplied by
    the key up-projection (absorbed), then the rope part. ``write_kv`` takes the latent
    ``[T, kv_lora_rank + rope_dim]`` (or ``[T, 1, ...]``) as ``key`` and ``value=None``.
    Output: ``[T, H, kv_lora_rank]``, the latent value (apply the value up-projection after).
    Cache: uint8 ``[num_pages, page_bytes]``. ``forward`` also takes ``num_splits`` (split-KV
    with a log-sum-exp combine; equal to the unsplit result) and ``topk_indices`` (sparse
    attention: per-query positions in the sequence, -1 unused).
    """

    name: ClassVar[str] = "mla-reference"
    api_version: ClassVar[str] = "1.0"
    priority: ClassVar[int] = 5
    batch_invariant: ClassVar[bool] = True
    summary: ClassVar[str] = ("MLA attention over bf16/fp8/fp8-e8m0/mxfp8 KV records in "
                              "plain torch, any device")

    @classmethod
    def can_implement(cls, request: AttentionRequest, device: DeviceCapability) -> Verdict:
        del device  # plain torch: any device
        r = request
        if r.attention != "mla":
            return Verdict.handles(False, f"implements 'mla' attention only, request is "
                                          f"{r.attention!r}")
        if r.kv_lora_rank is None or r.rope_dim is None:
            return Verdict.reject(f"needs kv_lora_rank and rope_dim for MLA, request has "
                                  f"kv_lora_rank={r.kv_lora_rank}, rope_dim={r.rope_dim}")
        record = record_for(r)
        if isinstance(record, str):
            return Verdict.reject(record)
        return Verdict.all(
            Verdict.check(r.num_kv_heads == 1,
                          f"MLA keeps one shared latent KV head, request has "
                          f"num_kv_heads={r.num_kv_heads}"),
            Verdict.check(r.num_heads >= 1, f"needs num_heads >= 1, request has {r.num_heads}"),
            Verdict.check(r.dtype in QUERY_DTYPES,
                          f"computes for query dtypes {list(QUERY_DTYPES)}, request has "
                          f"{r.dtype!r}"),
            Verdict.check(r.page_size >= 1,
                          f"needs page_size >= 1 tokens, request has {r.page_size}"),
            Verdict.check(r.sparse_topk is None or r.sparse_topk >= 1,
                          f"needs sparse_topk >= 1 when set, request has {r.sparse_topk}"),
            Verdict.check(r.sliding_window is None or r.sliding_window >= 1,
                          f"needs sliding_window >= 1 when set, request has "
                          f"{r.sliding_window}"),
        )

    def __init__(self, request: AttentionRequest) -> None:
        super().__init__(request)
        record = record_for(request)
        if isinstance(record, str):
            raise ValueError(f"{self.name}: {record}")
        self.record = record

    def kv_layout(self) -> KVCacheLayout:
        return self.record.layout(self.request.page_size)

    def allocate_cache(self, num_pages: int, device: torch.device | str) -> torch.Tensor:
        import torch

        return torch.zeros((num_pages, self.kv_layout().page_bytes), dtype=torch.uint8,
                           device=device)

    def latents(self, key: torch.Tensor, value: torch.Tensor | None,
                slot_mapping: torch.Tensor) -> torch.Tensor:
        """``write_kv``'s ``key`` as the latents [T, kv_lora_rank + rope_dim] to encode;
        raises ``ValueError`` naming the shapes when they are not that (or [T, 1, ...]), do
        not match ``slot_mapping`` [T], or a ``value`` is given."""
        if value is not None:
            raise ValueError(f"{self.name}: MLA caches one latent per token; pass it as key "
                             f"and value=None, got a value of shape {tuple(value.shape)}")
        latent = key[:, 0] if key.dim() == 3 and key.shape[1] == 1 else key
        if (latent.dim() != 2 or latent.shape[0] != slot_mapping.shape[0]
                or latent.shape[1] != self.record.latent_dim):
            raise ValueError(f"{self.name}: write_kv wants key [T, {self.record.latent_dim}] "
                             f"(or [T, 1, {self.record.latent_dim}]) and slot_mapping [T], got "
                             f"{tuple(key.shape)} and {tuple(slot_mapping.shape)}")
        return latent

    def write_kv(self, cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None,
                 slot_mapping: torch.Tensor) -> None:
        """Encode the latents ``key`` [T, kv_lora_rank + rope_dim] into their slots."""
        from kernelbay_attn_flashmla.codec import encode_records
        from kernelbay_attn_flashmla.mla import token_view

        latent = self.latents(key, value, slot_mapping)
        page_size = self.request.page_size
        tokens = token_view(cache, self.record, page_size)
        slots = slot_mapping.long()
        tokens[slots // page_size, slots % page_size] = encode_records(self.record, latent)

    def forward(self, query: torch.Tensor, cache: torch.Tensor, metadata: AttentionMetadata,
                scale: float, *, num_splits: int | None = None,
                topk_indices: torch.Tensor | None = None) -> torch.Tensor:
        """Latent output ``[T, H, kv_lora_rank]``; see the class docstring for the layout."""
        return self.forward_with_lse(query, cache, metadata, scale, num_splits=num_splits,
                                     topk_indices=topk_indices)[0]

    def forward_with_lse(self, query: torch.Tensor, cache: torch.Tensor,
                         metadata: AttentionMetadata, scale: float, *,
                         num_splits: int | None = None,
                         topk_indices: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` plus the log-sum-exp of the scores ``[T, H]`` (float32);
        ``num_splits`` None means 1 here."""
        from kernelbay_attn_flashmla.mla import mla_attention

        r = self.request
        self._check_call(query, topk_indices)
        return mla_attention(query, cache, self.record, r.page_size, metadata, scale,
                             num_splits=1 if num_splits is None else num_splits, topk_indices=topk_indices,
                             sliding_window=r.sliding_window)

    def _check_call(self, query: torch.Tensor, topk_indices: torch.Tensor | None) -> None:
        """Raise if ``query``'s heads or ``topk_indices`` do not fit the request."""
        r = self.request
        if r.sparse_topk is not None:
            if topk_indices is None:
                raise ValueError(f"{self.name}: the request is sparse (top-{r.sparse_topk}); "
                                 "forward needs topk_indices [T, K]")
            if topk_indices.shape[-1] > r.sparse_topk:
                raise ValueError(f"{self.name}: topk_indices has {topk_indices.shape[-1]} "
                                 f"entries per query, the request allows {r.sparse_topk}")
        if query.shape[1] != r.num_heads:
            raise ValueError(f"{self.name}: query has {query.shape[1]} heads, the request "
                             f"has {r.num_heads}")
