"""The always-available MLA attention (absorbed form) over paged latents, in plain torch.

Same interface as the ``attn_flashmla`` plugin's backends, with the latent stored in the
model dtype (no compact records)::

    query  [T, H, kv_lora_rank + rope_dim]   absorbed nope part (q_nope @ W_UK), then rope part
    latent [T, kv_lora_rank + rope_dim]      normed c_kv, then the roped k_pe (write_kv's key)
    s[l, h, j] = scale * (query[l, h] . latent[j]),  j <= pos(l) (causal)
    out[l, h]  = sum_j softmax_j(s)[j] * latent[j, :kv_lora_rank]      [T, H, kv_lora_rank]

The caller applies the value up-projection (W_UV) to ``out``.
"""

from __future__ import annotations

import itertools
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

__all__ = ["TorchMLAAttention"]

# Record kinds this backend stores, by name, with the torch dtype and its size in bytes.
_RECORDS = {"bf16": ("bfloat16", 2), "fp16": ("float16", 2), "fp32": ("float32", 4)}
_DTYPE_RECORD = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def _record(request: AttentionRequest) -> str:
    return _DTYPE_RECORD.get(request.dtype, "?") if request.kv_cache == "auto" else request.kv_cache


class TorchMLAAttention(AttentionBackend):
    """Absorbed MLA attention in plain torch: one shared latent per token in the model dtype
    (or a bf16/fp16/fp32 record), fp32 softmax, any device.

    Cache layout per layer: ``[num_pages, page_size, kv_lora_rank + rope_dim]``.
    ``write_kv`` takes the latent as ``key`` ([T, D] or [T, 1, D]) and ``value=None``.
    """

    name: ClassVar[str] = "torch-mla"
    api_version: ClassVar[str] = PLUGIN_API_VERSION
    priority: ClassVar[int] = 0
    # all of a step's query rows share one matmul, whose kernel may change with their number
    batch_invariant: ClassVar[bool] = False
    summary: ClassVar[str] = "MLA (absorbed) paged attention, model-dtype latents, plain torch"

    @classmethod
    def can_implement(cls, request: AttentionRequest, device: DeviceCapability) -> Verdict:
        del device  # plain torch: any device
        r = request
        return Verdict.all(
            Verdict.handles(r.attention == "mla",
                            f"implements 'mla' attention only, request is {r.attention!r}"),
            Verdict.check(bool(r.kv_lora_rank) and bool(r.rope_dim),
                          f"needs kv_lora_rank and rope_dim for MLA, request has "
                          f"kv_lora_rank={r.kv_lora_rank}, rope_dim={r.rope_dim}"),
            Verdict.check(_record(r) in _RECORDS,
                          f"stores MLA latents as {sorted(_RECORDS)} records only (kv_cache "
                          f"'auto' means the model dtype), request asks {r.kv_cache!r} with "
                          f"dtype {r.dtype!r}"),
            Verdict.check(r.num_kv_heads == 1,
                          f"keeps one shared latent KV head, request has "
                          f"num_kv_heads={r.num_kv_heads}"),
            Verdict.check(r.sparse_topk is None,
                          f"has no sparse top-k attention, request asks top-{r.sparse_topk}"),
        )

    @property
    def latent_dim(self) -> int:
        """``kv_lora_rank + rope_dim``: the width of one cached token."""
        return (self.request.kv_lora_rank or 0) + (self.request.rope_dim or 0)

    def kv_layout(self) -> KVCacheLayout:
        record = _record(self.request)
        return KVCacheLayout(self.latent_dim * _RECORDS[record][1], self.request.page_size,
                             record=record)

    def allocate_cache(self, num_pages: int, device: torch.device | str) -> torch.Tensor:
        import torch

        dtype = getattr(torch, _RECORDS[_record(self.request)][0])
        return torch.zeros((num_pages, self.request.page_size, self.latent_dim), dtype=dtype,
                           device=device)

    def write_kv(self, cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None,
                 slot_mapping: torch.Tensor) -> None:
        if value is not None:
            raise ValueError(f"{self.name}: MLA caches one latent per token; pass it as key "
                             f"and value=None, got a value of shape {tuple(value.shape)}")
        latent = key[:, 0] if key.dim() == 3 and key.shape[1] == 1 else key
        if latent.dim() != 2 or latent.shape[-1] != self.latent_dim:
            raise ValueError(f"{self.name}: write_kv wants key [T, {self.latent_dim}] (or "
                             f"[T, 1, {self.latent_dim}]), got {tuple(key.shape)}")
        page_size = self.request.page_size
        slots = slot_mapping.long()
        cache[slots // page_size, slots % page_size] = latent.to(cache.dtype)

    def forward(self, query: torch.Tensor, cache: torch.Tensor, metadata: AttentionMetadata,
                scale: float) -> torch.Tensor:
        import torch

        r = self.request
        rank = r.kv_lora_rank or 0
        starts = metadata.host_query_starts()
        if len(starts) > 1 and all(b - a == 1 for a, b in itertools.pairwise(starts)):
            return self._decode(query, cache, metadata, scale)
        out = query.new_zeros(query.shape[0], query.shape[1], rank)
        for b, context in enumerate(metadata.host_seq_lens()):
            q = query[starts[b]:starts[b + 1]].float()                 # [L, H, D]
            num_new = q.shape[0]
            if num_new == 0:
                continue
            pages = metadata.block_tables[b, :-(-context // r.page_size)].long()
            latent = cache[pages].reshape(-1, self.latent_dim)[:context].float()  # [C, D]
            scores = torch.einsum("lhd,cd->hlc", q, latent) * scale   # [H, L, C]
            allowed = visible_keys(torch.arange(context - num_new, context, device=q.device),
                                   context, r.sliding_window)   # [L, C]
            probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
            out[starts[b]:starts[b + 1]] = torch.einsum("hlc,cr->lhr", probs,
                                                        latent[:, :rank]).to(out.dtype)
        return out

    def _decode(self, query: torch.Tensor, cache: torch.Tensor, metadata: AttentionMetadata,
                scale: float) -> torch.Tensor:
        """One new token per sequence: the whole batch at once, keys padded to the bound on
        the longest context (``seq_len_bound``) and masked, so no length is read on the host
        (and the step can be captured in a CUDA graph)."""
        import torch

        r = self.request
        rank = r.kv_lora_rank or 0
        batch = query.shape[0]
        lengths = metadata.seq_lens.long()
        context, pages = metadata.padded_key_pages(r.page_size)
        latent = cache[pages].reshape(batch, -1, self.latent_dim)[:, :context].float()
        scores = torch.einsum("bhd,bcd->bhc", query.float(), latent) * scale  # [B, H, C]
        allowed = visible_keys(lengths - 1, context, r.sliding_window)   # [B, C]
        probs = torch.softmax(scores.masked_fill(~allowed[:, None, :], float("-inf")), dim=-1)
        return torch.einsum("bhc,bcr->bhr", probs, latent[..., :rank]).to(query.dtype)
