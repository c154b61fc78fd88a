"""Absorbed MLA attention over paged MLA records, in torch (the reference).

Math (one shared latent KV head; per query token l, head h, context token j)::

    q[l, h]  = [ q_nope_absorbed (kv_lora_rank) | q_rope (rope_dim) ]     the query layout
    k[j]     = [ c[j] (kv_lora_rank)            | k_rope[j] (rope_dim) ]  decoded record j
    s[l,h,j] = scale * (q_nope . c[j] + q_rope . k_rope[j]) = scale * (q[l, h] . k[j])
    allowed  = j <= pos(l)  (causal), and j > pos(l) - window, and j in topk(l) when sparse
    o[l, h]  = sum_j softmax_j(s)[j] * c[j]                             [kv_lora_rank]
    lse[l,h] = log sum_{allowed j} exp(s[l, h, j])

pos(l) = seq_len - num_new + l: the new tokens are the last ones of their sequence.
Split-KV: the context is cut into ``num_splits`` contiguous chunks; each gives a partial
(o_i, lse_i) over its own keys and ``combine_splits`` merges them exactly:
lse = logsumexp_i lse_i, o = sum_i exp(lse_i - lse) * o_i. A query with no allowed key
(possible only with sparse indices) gets o = 0 and lse = -inf. A batch of one new token per
sequence (no sparse indices) is attended in one pass instead, keys padded to the longest
context and masked, so that no length is read on the host (CUDA graph captures); splitting
would equal it up to rounding, so ``num_splits`` is not used there.
"""

from __future__ import annotations

import itertools

import torch
from kernelbay.layers import AttentionMetadata, visible_keys
from torch import Tensor

from kernelbay_attn_flashmla.codec import decode_records
from kernelbay_attn_flashmla.records import MLARecord

__all__ = ["combine_splits", "mla_attention", "token_view"]


def token_view(cache: Tensor, record: MLARecord, page_size: int) -> Tensor:
    """A ``[num_pages, page_size, bytes_per_token]`` view of a cache that is either
    ``[num_pages, page_bytes]`` (page stride may include alignment padding) or already
    ``[num_pages, page_size, bytes_per_token]``; writes through the view reach the cache."""
    bpt = record.bytes_per_token
    if cache.dtype != torch.uint8:
        raise ValueError(f"an MLA record cache is uint8, got {cache.dtype}")
    if cache.dim() == 3 and tuple(cache.shape[1:]) == (page_size, bpt):
        return cache
    if cache.dim() == 2 and cache.shape[1] >= page_size * bpt:
        # Splitting the (stride-1) byte dimension is a view even when pages are padded.
        return cache[:, :page_size * bpt].view(cache.shape[0], page_size, bpt)
    raise ValueError(f"{record.kind} cache must be [num_pages, >= {page_size * bpt}] or "
                     f"[num_pages, {page_size}, {bpt}] uint8, got {tuple(cache.shape)}")


def combine_splits(outs: Tensor, lses: Tensor) -> tuple[Tensor, Tensor]:
    """Merge split-KV partials: ``outs`` [S, ..., D] and ``lses`` [S, ...] -> (out, lse).

    Each partial is normalised over its own keys; a split without keys has lse = -inf and
    contributes nothing.
    """
    lse = torch.logsumexp(lses, dim=0)
    # exp(-inf - -inf) is NaN: where no split had a key, every weight is 0.
    finite = torch.isfinite(lse)
    weights = torch.where(finite, torch.exp(lses - torch.where(finite, lse, 0.0)), 0.0)
    return (weights.unsqueeze(-1) * outs).sum(dim=0), lse


def _partial(scores: Tensor, allowed: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
    """Softmax attention over one chunk of keys: scores [L, H, C], allowed [L, C], values
    [C, D] -> (out [L, H, D], lse [L, H])."""
    masked = scores.masked_fill(~allowed[:, None, :], float("-inf"))
    lse = torch.logsumexp(masked, dim=-1)
    probs = torch.exp(masked - torch.where(torch.isfinite(lse), lse, 0.0).unsqueeze(-1))
    return torch.einsum("lhc,cd->lhd", probs, values), lse


def mla_attention(query: Tensor, cache: Tensor, record: MLARecord, page_size: int,
                  metadata: AttentionMetadata, scale: float, *, num_splits: int = 1,
                  topk_indices: Tensor | None = None, sliding_window: int | None = None
                  ) -> tuple[Tensor, Tensor]:
    """Absorbed MLA attention of new queries over their sequences' cached records.

    ``query`` [T, H, kv_lora_rank + rope_dim] (absorbed nope part, then rope part);
    ``cache`` uint8 pages (see ``token_view``); ``metadata`` as the core's
    ``AttentionMetadata`` describes. ``topk_indices`` [T, K] int: for each query, positions
    within its own sequence (0 .. seq_len - 1) it may attend to, -1 for unused entries; the
    causal rule still applies. Returns ``(out [T, H, kv_lora_rank] in query.dtype,
    lse [T, H] float32)``; computed in float32.
    """
    dim = record.latent_dim
    if query.dim() != 3 or query.shape[-1] != dim:
        raise ValueError(f"{record.kind} MLA query is [T, H, {record.dims_text} = {dim}], got "
                         f"{tuple(query.shape)}")
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    tokens = token_view(cache, record, page_size)
    num_tokens, heads = query.shape[:2]
    if topk_indices is not None and (topk_indices.dim() != 2
                                     or topk_indices.shape[0] != num_tokens):
        raise ValueError(f"topk_indices must be [T={num_tokens}, K], got "
                         f"{tuple(topk_indices.shape)}")
    rank = record.kv_lora_rank
    out = torch.zeros(num_tokens, heads, rank, dtype=query.dtype, device=query.device)
    lse_out = torch.full((num_tokens, heads), float("-inf"), device=query.device)
    starts = metadata.host_query_starts()
    if topk_indices is None and len(starts) > 1 and all(
            b - a == 1 for a, b in itertools.pairwise(starts)):
        return _decode_batch(query, tokens, record, page_size, metadata, scale, sliding_window)
    lengths = metadata.host_seq_lens()
    for b, context in enumerate(lengths):
        begin, end = starts[b], starts[b + 1]
        num_new = end - begin
        if num_new == 0:
            continue
        if num_new > context:
            raise ValueError(f"sequence {b} has {num_new} new tokens but seq_len {context}")
        pages = metadata.block_tables[b, :-(-context // page_size)].long()
        latent = decode_records(record, tokens[pages].reshape(-1, record.bytes_per_token)
                                [:context])                              # [C, dim] float32
        q = query[begin:end].float()                                     # [L, H, dim]
        scores = torch.einsum("lhd,cd->lhc", q, latent) * scale
        allowed = visible_keys(torch.arange(context - num_new, context, device=q.device),
                               context, sliding_window)                  # [L, C]
        if topk_indices is not None:
            allowed &= _selected(topk_indices[begin:end], context)
        bounds = _split_bounds(context, num_splits)
        parts = [_partial(scores[..., a:z], allowed[:, a:z], latent[a:z, :rank])
                 for a, z in itertools.pairwise(bounds)]
        o, lse = combine_splits(torch.stack([p[0] for p in parts]),
                                torch.stack([p[1] for p in parts]))
        out[begin:end] = o.to(out.dtype)
        lse_out[begin:end] = lse
    return out, lse_out


def _decode_batch(query: Tensor, tokens: Tensor, record: MLARecord, page_size: int,
                  metadata: AttentionMetadata, scale: float,
                  sliding_window: int | None) -> tuple[Tensor, Tensor]:
    """``mla_attention`` of one new token per sequence, the whole batch at once: keys padded
    to the bound on the longest context (``seq_len_bound``) and masked, so no length is read
    on the host (the step can be captured in a CUDA graph). One pass over the keys: a split
    combine equals it up to rounding."""
    batch = query.shape[0]
    lengths = metadata.seq_lens.long()
    context, pages = metadata.padded_key_pages(page_size)
    latent = decode_records(record, tokens[pages].reshape(batch, -1, record.bytes_per_token)
                            [:, :context])                               # [B, C, dim] float32
    scores = torch.einsum("bhd,bcd->bhc", query.float(), latent) * scale
    allowed = visible_keys(lengths - 1, context, sliding_window)         # [B, C]
    masked = scores.masked_fill(~allowed[:, None, :], float("-inf"))
    lse = torch.logsumexp(masked, dim=-1)                                # [B, H]
    probs = torch.exp(masked - torch.where(torch.isfinite(lse), lse, 0.0).unsqueeze(-1))
    out = torch.einsum("bhc,bcr->bhr", probs, latent[..., :record.kv_lora_rank])
    return out.to(query.dtype), lse


def _split_bounds(context: int, num_splits: int) -> list[int]:
    # Equal chunks (the last may be shorter); more splits than keys leaves empty chunks,
    # which combine_splits must (and does) ignore.
    size = max(1, -(-context // num_splits))
    return [min(i * size, context) for i in range(num_splits + 1)]


def _selected(indices: Tensor, context: int) -> Tensor:
    """Boolean [L, context] of the positions each query's top-k indices name."""
    idx = indices.long()
    if bool(((idx < -1) | (idx >= context)).any()):
        bad = idx[(idx < -1) | (idx >= context)][:4].tolist()
        raise ValueError(f"topk indices must be in [0, {context}) or -1 for unused, got {bad}")
    # Unused entries (-1) go to an extra column that is dropped.
    idx = torch.where(idx < 0, context, idx)
    chosen = torch.zeros(idx.shape[0], context + 1, dtype=torch.bool, device=idx.device)
    chosen.scatter_(1, idx, True)
    return chosen[:, :context]
