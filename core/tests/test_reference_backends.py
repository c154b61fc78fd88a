"""The core's plain-torch reference backends against torch's own operators."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from kernelbay import AttentionRequest, LinearRequest, ProposerRequest, parse_device
from kernelbay.layers import AttentionMetadata, DraftBuffers
from kernelbay.layers.ngram_proposer import NGramProposer, ngram_lookup
from kernelbay.layers.torch_attention import TorchPagedAttention
from kernelbay.layers.torch_linear import TorchUnquantizedLinear

CPU = parse_device("cpu")


@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("bias", [False, True])
def test_unquantized_linear_matches_f_linear(m: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(m)
    method = TorchUnquantizedLinear(LinearRequest(48, 80, activation_dtype="float32", bias=bias))
    layer = torch.nn.Module()
    method.create_weights(layer)
    assert layer.weight.shape == (80, 48)
    layer.weight.data.copy_(torch.randn(80, 48, generator=gen))
    if bias:
        layer.bias.data.copy_(torch.randn(80, generator=gen))
    method.process_weights_after_loading(layer)
    x = torch.randn(m, 48, generator=gen)
    expected = F.linear(x, layer.weight, layer.bias if bias else None)
    assert torch.equal(method.apply(layer, x), expected)


def test_row_parallel_bias_is_added_on_rank_zero_only() -> None:
    layer = torch.nn.Module()
    req = LinearRequest(8, 4, activation_dtype="float32", bias=True, parallel="row",
                        tp_rank=1, tp_size=2)
    method = TorchUnquantizedLinear(req)
    method.create_weights(layer)
    layer.weight.data.zero_()
    layer.bias.data.fill_(3.0)
    assert torch.equal(method.apply(layer, torch.ones(2, 8)), torch.zeros(2, 4))


def _paged_setup(lengths: list[int], new: list[int], heads: int, kv_heads: int, dim: int,
                 page: int, seed: int, window: int | None = None) -> tuple[TorchPagedAttention, torch.Tensor, torch.Tensor,
                                               AttentionMetadata, list[torch.Tensor],
                                               list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    request = AttentionRequest("gqa" if kv_heads < heads else "mha", heads, kv_heads, dim,
                               dtype="float32", page_size=page, sliding_window=window)
    backend = TorchPagedAttention(request)
    pages_per_seq = [math.ceil(n / page) for n in lengths]
    total_pages = sum(pages_per_seq) + 3
    cache = backend.allocate_cache(total_pages, "cpu")
    order = torch.randperm(total_pages, generator=gen)  # random page table
    tables = torch.zeros(len(lengths), max(pages_per_seq), dtype=torch.int32)
    used = 0
    keys, values, queries, slots = [], [], [], []
    for b, (n, q_len) in enumerate(zip(lengths, new, strict=True)):
        tables[b, :pages_per_seq[b]] = order[used:used + pages_per_seq[b]]
        used += pages_per_seq[b]
        k = torch.randn(n, kv_heads, dim, generator=gen)
        v = torch.randn(n, kv_heads, dim, generator=gen)
        keys.append(k)
        values.append(v)
        queries.append(torch.randn(q_len, heads, dim, generator=gen))
        pos = torch.arange(n)
        slot = tables[b, pos // page].long() * page + pos % page
        backend.write_kv(cache, k, v, slot)
        slots.append(slot[n - q_len:])
    starts = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(starts, torch.tensor(lengths, dtype=torch.int32), tables,
                             torch.cat(slots))
    return backend, cache, torch.cat(queries), meta, keys, values, queries


@pytest.mark.parametrize("new", [[1, 7, 1, 5],     # a decode, a prefill, chunked continuations
                                 [1, 1, 1, 1],     # a pure decode batch (the batched path)
                                 [2, 0, 33, 3]])   # a sequence with no new token
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2), (6, 1)])
# 90 kB forms groups of two or three for [1, 7, 1, 5] (test_prefill_groups_...)
@pytest.mark.parametrize("budget", [None, 1, 90_000], ids=["one-group", "singles", "groups"])
@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_matches_sdpa_for_prefill_and_decode(
        heads: int, kv_heads: int, new: list[int], budget: int | None, window: int | None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Against SDPA per sequence; mixed batches are attended in groups of sequences (padded,
    masked) as large as the score budget allows: all at once, one by one, or in between."""
    from kernelbay.layers import torch_attention

    if budget is not None:
        monkeypatch.setattr(torch_attention, "VARLEN_GROUP_BYTES", budget)
    lengths = [2, 7, 33, 16]
    backend, cache, query, meta, keys, values, queries = _paged_setup(
        lengths, new, heads, kv_heads, 16, 8, seed=heads, window=window)
    out = backend.forward(query, cache, meta, scale=16 ** -0.5)
    start = 0
    for b, (n, q_len) in enumerate(zip(lengths, new, strict=True)):
        q = queries[b].transpose(0, 1)                                     # [H, L, D]
        k = keys[b].repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        v = values[b].repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        k_pos, q_pos = torch.arange(n)[None, :], torch.arange(n - q_len, n)[:, None]
        mask = (k_pos <= q_pos) & (k_pos > q_pos - window if window else True)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=16 ** -0.5)
        torch.testing.assert_close(out[start:start + q_len], ref.transpose(0, 1),
                                   rtol=1e-5, atol=1e-5)
        start += q_len


def test_prefill_groups_fill_the_budget_and_leave_out_sequences_without_new_tokens(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kernelbay.layers import torch_attention
    from kernelbay.layers.torch_attention import _groups

    monkeypatch.setattr(torch_attention, "VARLEN_GROUP_BYTES", 90_000)
    counts, lengths = [1, 7, 1, 5], [2, 7, 33, 16]
    # bytes of n sequences: n * 4 * (3 * heads * most new * longest + 2 * kv floats * longest)
    assert _groups(counts, lengths, 4, 128) == [(0, 2), (2, 4)]     # 3 would take 134640
    assert _groups(counts, lengths, 8, 64) == [(0, 2), (2, 4)]
    assert _groups(counts, lengths, 6, 32) == [(0, 3), (3, 4)]      # 4 would take 100320
    assert _groups([2, 0, 33, 3], lengths, 4, 128) == [(0, 1), (2, 3), (3, 4)]
    assert _groups([0, 0], [3, 4], 4, 128) == [] and _groups([], [], 4, 128) == []
    monkeypatch.setattr(torch_attention, "VARLEN_GROUP_BYTES", 1)
    assert _groups(counts, lengths, 4, 128) == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_kv_layout_is_derived_from_the_request() -> None:
    backend = TorchPagedAttention(AttentionRequest("gqa", 32, 8, 128, page_size=16))
    layout = backend.kv_layout()
    assert layout.bytes_per_token == 2 * 8 * 128 * 2
    assert layout.page_bytes % layout.alignment == 0
    assert layout.page_bytes >= layout.bytes_per_token * 16


def test_paged_attention_rejects_records_it_cannot_store() -> None:
    verdict = TorchPagedAttention.can_implement(
        AttentionRequest("mla", 16, 1, 192, 128, 512, 64, kv_cache="fp8"), CPU)
    assert not verdict and "'mla'" in verdict.reason


@pytest.mark.parametrize("tokens, k, expected", [
    ([1, 2, 3, 4, 1, 2], 3, [3, 4, 1]),
    ([5, 6, 7, 5, 6, 9, 5, 6], 2, [9, 5]),       # the most recent match wins
    ([1, 2, 3], 4, []),
    ([7, 7, 7], 2, [7]),
    ([], 2, []),
])
def test_ngram_lookup(tokens: list[int], k: int, expected: list[int]) -> None:
    assert ngram_lookup(tokens, k) == expected


def test_ngram_proposer_fills_the_core_buffers() -> None:
    proposer = NGramProposer(ProposerRequest("ngram", 4, 100))
    spec = proposer.draft_logits_spec()
    out = DraftBuffers.allocate(spec, 2, 4, 100)
    proposer.propose([torch.tensor([1, 2, 3, 1, 2]), torch.tensor([9, 8])], out)
    assert out.num_drafted.tolist() == [3, 0]
    assert out.tokens[0, :3].tolist() == [3, 1, 2]
    assert out.candidate_ids is not None and out.candidate_probs is not None
    assert out.candidate_probs[0, :3, 0].tolist() == [1.0, 1.0, 1.0]
    assert out.candidate_probs[1].sum().item() == 0.0
