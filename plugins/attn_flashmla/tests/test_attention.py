"""mla-reference against plain unpaged MLA attention, for every record kind."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from _bounds import element_bound
from kernelbay import AttentionRequest, parse_device
from kernelbay.layers import AttentionMetadata
from kernelbay_attn_flashmla.backend import MLAReferenceAttention
from kernelbay_attn_flashmla.codec import decode_records, encode_records
from kernelbay_attn_flashmla.records import RECORDS

CPU = parse_device("cpu")
KINDS = sorted(RECORDS)


@dataclass
class Paged:
    backend: MLAReferenceAttention
    cache: torch.Tensor
    query: torch.Tensor
    meta: AttentionMetadata
    latents: list[torch.Tensor]        # the exact latents written, per sequence
    queries: list[torch.Tensor]


def _paged(kind: str, lengths: list[int], new: list[int], heads: int, page: int, seed: int,
           sparse_topk: int | None = None, window: int | None = None) -> Paged:
    gen = torch.Generator().manual_seed(seed)
    record = RECORDS[kind]
    request = AttentionRequest("mla", heads, 1, 192, 128, record.kv_lora_rank, record.rope_dim,
                               dtype="float32", kv_cache=kind, page_size=page,
                               sparse_topk=sparse_topk, sliding_window=window)
    assert MLAReferenceAttention.can_implement(request, CPU)
    backend = MLAReferenceAttention(request)
    pages_per_seq = [math.ceil(n / page) for n in lengths]
    total = sum(pages_per_seq) + 2
    cache = backend.allocate_cache(total, "cpu")
    order = torch.randperm(total, generator=gen)                  # a random page table
    tables = torch.zeros(len(lengths), max(pages_per_seq), dtype=torch.int32)
    latents, queries, slots = [], [], []
    used = 0
    for b, (n, q_len) in enumerate(zip(lengths, new, strict=True)):
        tables[b, :pages_per_seq[b]] = order[used:used + pages_per_seq[b]]
        used += pages_per_seq[b]
        latent = torch.randn(n, record.latent_dim, generator=gen)
        latent[:, record.kv_lora_rank:] *= 3                      # rope part on its own scale
        latents.append(latent)
        queries.append(torch.randn(q_len, heads, record.latent_dim, generator=gen))
        pos = torch.arange(n)
        slot = tables[b, pos // page].long() * page + pos % page
        # Write the context in two calls, as a prefill then a decode step would.
        cut = n - q_len
        backend.write_kv(cache, latent[:cut], None, slot[:cut])
        backend.write_kv(cache, latent[cut:, None, :], None, slot[cut:])   # [T, 1, D] too
        slots.append(slot[cut:])
    starts = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(starts, torch.tensor(lengths, dtype=torch.int32), tables,
                             torch.cat(slots))
    return Paged(backend, cache, torch.cat(queries), meta, latents, queries)


def plain_mla(q: torch.Tensor, latent: torch.Tensor, rank: int, scale: float,
              allowed: torch.Tensor) -> torch.Tensor:
    """Unpaged MLA in latent form, float64: s = q_nope.c + q_rope.k_rope, softmax, p.c."""
    q, latent = q.double(), latent.double()
    scores = (torch.einsum("lhd,cd->lhc", q[..., :rank], latent[:, :rank])
              + torch.einsum("lhd,cd->lhc", q[..., rank:], latent[:, rank:])) * scale
    scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
    return torch.einsum("lhc,cd->lhd", torch.softmax(scores, -1), latent[:, :rank])


def _causal(n: int, q_len: int) -> torch.Tensor:
    return torch.arange(n)[None, :] <= torch.arange(n - q_len, n)[:, None]


LENGTHS, NEW = [1, 9, 40, 130, 17], [1, 9, 1, 6, 3]   # decode, prefill, chunked continuations
# One new token each: the batch is attended at once, keys padded to the longest and masked.
DECODE = [1] * len(LENGTHS)


@pytest.mark.parametrize("page", [16, 5])
@pytest.mark.parametrize("new", [NEW, DECODE], ids=["mixed", "decode"])
def test_bf16_records_equal_plain_mla(page: int, new: list[int]) -> None:
    paged = _paged("bf16", LENGTHS, new, heads=4, page=page, seed=page)
    scale = 192 ** -0.5
    out = paged.backend.forward(paged.query, paged.cache, paged.meta, scale)
    assert out.shape == (sum(new), 4, 512) and out.dtype == torch.float32
    start = 0
    for b, (n, q_len) in enumerate(zip(LENGTHS, new, strict=True)):
        exact = paged.latents[b].bfloat16().float()            # what a bf16 record holds
        ref = plain_mla(paged.queries[b], exact, 512, scale, _causal(n, q_len))
        torch.testing.assert_close(out[start:start + q_len].double(), ref, rtol=1e-5,
                                   atol=1e-5)
        start += q_len


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("new", [NEW, DECODE], ids=["mixed", "decode"])
def test_quantized_records_within_the_format_bound(kind: str, new: list[int]) -> None:
    """Attention over quantized records stays within a bound derived from the format.

    With E_j the per-element record bound of context token j (_bounds.py:
    2^-4 |x| + 2^-10 s for E4M3 values, 2^-8 |x| for bf16), a score moves by at most
    D_j = scale * sum_d |q_d| E_jd; with D = max_j D_j the softmax weights move by a factor
    within [e^-2D, e^2D], so sum_j |p'_j - p_j| <= e^2D - 1. Then per output dim d:
    |o'_d - o_d| <= max_j E_jd (values) + (e^2D - 1) max_j |c_jd| (weights), plus float32
    round-off. The test also checks attention over the decoded records equals plain MLA on
    them to round-off, so the bound tests the format and not a loose kernel.
    """
    record = RECORDS[kind]
    rank = record.kv_lora_rank
    paged = _paged(kind, LENGTHS, new, heads=3, page=16, seed=len(kind))
    scale = 192 ** -0.5
    out = paged.backend.forward(paged.query, paged.cache, paged.meta, scale).double()
    start = 0
    for b, (n, q_len) in enumerate(zip(LENGTHS, new, strict=True)):
        x, q = paged.latents[b], paged.queries[b]
        allowed = _causal(n, q_len)
        got = out[start:start + q_len]
        decoded = decode_records(record, encode_records(record, x))
        torch.testing.assert_close(got, plain_mla(q, decoded, rank, scale, allowed),
                                   rtol=1e-5, atol=1e-5)
        bound_e = element_bound(record, x).double()                  # [C, dim]
        shift = scale * torch.einsum("lhd,cd->lhc", q.double().abs(), bound_e)
        shift = shift.masked_fill(~allowed[:, None, :], 0.0).amax(-1)  # D per (l, h)
        value_err = torch.stack([bound_e[allowed[i], :rank].amax(0) for i in range(q_len)])
        c_max = torch.stack([x.double()[allowed[i], :rank].abs().amax(0)
                             for i in range(q_len)])
        bound = (value_err[:, None, :] + torch.expm1(2 * shift)[..., None] * c_max[:, None, :]
                 + 1e-5)
        err = (got - plain_mla(q, x, rank, scale, allowed)).abs()
        assert bool((err <= bound).all()), (kind, b, (err - bound).max())
        start += q_len


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("splits", [2, 3, 8, 200])
def test_split_kv_equals_unsplit(kind: str, splits: int) -> None:
    # (decode-only batches take one pass whatever num_splits says: nothing to compare there)
    paged = _paged(kind, LENGTHS, NEW, heads=2, page=8, seed=splits)
    scale = 0.1
    out, lse = paged.backend.forward_with_lse(paged.query, paged.cache, paged.meta, scale)
    out_s, lse_s = paged.backend.forward_with_lse(paged.query, paged.cache, paged.meta, scale,
                                                  num_splits=splits)
    torch.testing.assert_close(out_s, out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse_s, lse, rtol=1e-6, atol=1e-5)


def test_lse_is_the_log_normaliser() -> None:
    paged = _paged("bf16", [12], [4], heads=2, page=4, seed=0)
    _, lse = paged.backend.forward_with_lse(paged.query, paged.cache, paged.meta, 0.2)
    latent = paged.latents[0].bfloat16().double()
    scores = torch.einsum("lhd,cd->lhc", paged.queries[0].double(), latent) * 0.2
    scores = scores.masked_fill(~_causal(12, 4)[:, None, :], float("-inf"))
    torch.testing.assert_close(lse.double(), torch.logsumexp(scores, -1), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("kind", ["bf16", "mxfp8"])
def test_sparse_topk_attends_to_the_chosen_positions_only(kind: str) -> None:
    lengths, new = [30, 50], [2, 3]
    paged = _paged(kind, lengths, new, heads=2, page=8, seed=3, sparse_topk=6)
    record = RECORDS[kind]
    gen = torch.Generator().manual_seed(4)
    indices = torch.full((5, 6), -1, dtype=torch.int32)     # column 4 stays unused (-1)
    allowed_rows = []
    row = 0
    for n, q_len in zip(lengths, new, strict=True):
        for i in range(q_len):
            chosen = torch.randperm(n, generator=gen)[:4]   # may name future positions
            indices[row, :4] = chosen.int()
            indices[row, 5] = 0                             # every query keeps one key
            mask = torch.zeros(n, dtype=torch.bool)
            mask[chosen] = True
            mask[0] = True
            mask &= torch.arange(n) <= n - q_len + i        # causal still applies
            allowed_rows.append(mask)
            row += 1
    out = paged.backend.forward(paged.query, paged.cache, paged.meta, 0.15,
                                topk_indices=indices)
    row = 0
    for b, q_len in enumerate(new):
        decoded = decode_records(record, encode_records(record, paged.latents[b]))
        allowed = torch.stack(allowed_rows[row:row + q_len])
        ref = plain_mla(paged.queries[b], decoded, record.kv_lora_rank, 0.15, allowed)
        torch.testing.assert_close(out[row:row + q_len].double(), ref, rtol=1e-5, atol=1e-5)
        row += q_len
    # A query whose indices are all unused sees no key: its output is zero.
    empty = torch.full((5, 6), -1, dtype=torch.int32)
    out = paged.backend.forward(paged.query, paged.cache, paged.meta, 0.15,
                                topk_indices=empty, num_splits=3)
    assert torch.equal(out, torch.zeros_like(out))
    with pytest.raises(ValueError, match="forward needs topk_indices"):
        paged.backend.forward(paged.query, paged.cache, paged.meta, 0.15)
    with pytest.raises(ValueError, match=r"topk indices must be in \[0, 30\)"):
        paged.backend.forward(paged.query, paged.cache, paged.meta, 0.15,
                              topk_indices=torch.full((5, 2), 30, dtype=torch.int32))


@pytest.mark.parametrize("new", [[5, 7], [1, 1]], ids=["mixed", "decode"])
def test_sliding_window(new: list[int]) -> None:
    lengths = [20, 7]
    paged = _paged("bf16", lengths, new, heads=2, page=4, seed=9, window=4)
    out = paged.backend.forward(paged.query, paged.cache, paged.meta, 0.3, num_splits=3)
    start = 0
    for b, (n, q_len) in enumerate(zip(lengths, new, strict=True)):
        k_pos, q_pos = torch.arange(n)[None, :], torch.arange(n - q_len, n)[:, None]
        allowed = (k_pos <= q_pos) & (k_pos > q_pos - 4)
        ref = plain_mla(paged.queries[b], paged.latents[b].bfloat16().float(), 512, 0.3,
                        allowed)
        torch.testing.assert_close(out[start:start + q_len].double(), ref, rtol=1e-5,
                                   atol=1e-5)
        start += q_len


def test_bf16_queries_and_three_dim_cache_view() -> None:
    paged = _paged("fp8", [10, 3], [2, 3], heads=2, page=4, seed=1)
    record = RECORDS["fp8"]
    out32 = paged.backend.forward(paged.query, paged.cache, paged.meta, 0.1)
    out16 = paged.backend.forward(paged.query.bfloat16(), paged.cache, paged.meta, 0.1)
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16.float(), out32, rtol=2e-2, atol=2e-2)
    pages = paged.cache[:, :4 * record.bytes_per_token].reshape(-1, 4, record.bytes_per_token)
    assert torch.equal(paged.backend.forward(paged.query, pages, paged.meta, 0.1), out32)


def test_writes_leave_page_padding_alone_and_check_inputs() -> None:
    # 3 tokens of 528 B = 1584 B, padded to a 1792 B page stride.
    paged = _paged("mxfp8", [7, 5], [1, 2], heads=1, page=3, seed=2)
    layout = paged.backend.kv_layout()
    assert paged.cache.shape[1] == layout.page_bytes > 3 * layout.bytes_per_token
    assert int(paged.cache[:, 3 * layout.bytes_per_token:].abs().sum()) == 0
    with pytest.raises(ValueError, match="value=None"):
        paged.backend.write_kv(paged.cache, torch.zeros(1, 512), torch.zeros(1, 512),
                               torch.zeros(1, dtype=torch.long))
    before = paged.cache.clone()
    for key, slots in ((torch.zeros(2, 576), 2), (torch.zeros(2, 512), 3),
                       (torch.zeros(2, 2, 512), 2)):
        with pytest.raises(ValueError, match=r"write_kv wants key \[T, 512\]"):
            paged.backend.write_kv(paged.cache, key, None, torch.zeros(slots, dtype=torch.long))
    assert torch.equal(paged.cache, before)  # nothing half-written
    # The Triton backend validates through the same method before any kernel runs.
    from kernelbay_attn_flashmla.triton_backend import MLATritonAttention

    triton_backend = MLATritonAttention(paged.backend.request)
    with pytest.raises(ValueError, match=r"write_kv wants key \[T, 512\]"):
        triton_backend.write_kv(paged.cache, torch.zeros(2, 576), None,
                                torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"MLA query is \[T, H, 448\+64 = 512\]"):
        paged.backend.forward(torch.zeros(3, 1, 576), paged.cache, paged.meta, 0.1)
    with pytest.raises(ValueError, match="num_splits must be >= 1, got 0"):
        paged.backend.forward(paged.query, paged.cache, paged.meta, 0.1, num_splits=0)
    with pytest.raises(ValueError, match="cache must be"):
        paged.backend.forward(paged.query, paged.cache[:, :100], paged.meta, 0.1)
