"""Batch-invariant paged attention (Triton interpreter on CPU, tiny shapes): matches the
core's torch references, and a token's output does not depend on the batch or on how many
new tokens its sequence brings."""

from __future__ import annotations

import pytest
import torch
from kernelbay import AttentionRequest, parse_device
from kernelbay.layers import AttentionMetadata
from kernelbay.layers.torch_attention import TorchPagedAttention
from kernelbay.layers.torch_mla import TorchMLAAttention
from kernelbay_batch_invariant.attention import (
    BatchInvariantMLAAttention,
    BatchInvariantPagedAttention,
)

# Tensors live on the CPU and the kernels run in the interpreter; test_gpu.py covers CUDA.
pytestmark = [pytest.mark.skipif(torch.cuda.is_available(),
                                 reason="interpreter tests (CPU tensors); test_gpu.py runs on CUDA"),
              pytest.mark.triton_interpreter]

PAGE = 4


def _fill(backend: object, lengths: list[int], width: tuple[int, ...], seed: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache holding ``lengths`` tokens per sequence, pages handed out shuffled."""
    g = torch.Generator().manual_seed(seed)
    pages_per = [-(-n // PAGE) for n in lengths]
    order = torch.randperm(sum(pages_per) + 3, generator=g)
    tables = torch.zeros(len(lengths), max(pages_per), dtype=torch.int32)
    at = 0
    for b, n in enumerate(pages_per):
        tables[b, :n] = order[at:at + n]
        at += n
    cache = backend.allocate_cache(sum(pages_per) + 3, "cpu")  # type: ignore[attr-defined]
    cache.copy_(torch.randn(cache.shape, generator=g).to(cache.dtype))
    del width
    return cache, tables


def _meta(tables: torch.Tensor, lengths: list[int], new: list[int]) -> AttentionMetadata:
    starts = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    return AttentionMetadata(starts, torch.tensor(lengths, dtype=torch.int32), tables,
                             torch.zeros(sum(new), dtype=torch.long))


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("heads, kv_heads, dim", [(4, 2, 8), (2, 2, 12), (3, 1, 16)])
def test_paged_matches_the_torch_reference(heads: int, kv_heads: int, dim: int,
                                           window: int | None) -> None:
    request = AttentionRequest("gqa", heads, kv_heads, dim, dtype="float32", page_size=PAGE,
                               sliding_window=window)
    ours, ref = BatchInvariantPagedAttention(request), TorchPagedAttention(request)
    lengths, new = [7, 1, 13], [3, 1, 13]
    cache, tables = _fill(ours, lengths, (), heads * 10 + dim)
    meta = _meta(tables, lengths, new)
    query = torch.randn(sum(new), heads, dim, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(ours.forward(query, cache, meta, 0.3),
                               ref.forward(query, cache, meta, 0.3), atol=2e-5, rtol=2e-5)


def test_paged_token_output_is_batch_and_length_invariant() -> None:
    request = AttentionRequest("gqa", 4, 2, 8, dtype="float32", page_size=PAGE)
    ours = BatchInvariantPagedAttention(request)
    cache, tables = _fill(ours, [70, 9, 30], (), 3)
    q = torch.randn(5, 4, 8, generator=torch.Generator().manual_seed(9))
    # sequence 0 verifying 4 draft tokens among a batch ...
    many = ours.forward(torch.cat([q[:4], q[4:5], q[4:5]]), cache,
                        _meta(tables, [70, 9, 30], [4, 1, 1]), 0.5)
    # ... and each of its tokens decoded alone: bitwise the same
    for j in range(4):
        alone = ours.forward(q[j:j + 1], cache, _meta(tables[:1], [67 + j], [1]), 0.5)
        assert torch.equal(alone[0], many[j])


def test_mla_matches_the_reference_and_is_invariant() -> None:
    request = AttentionRequest("mla", 3, 1, 24, 16, 16, 8, dtype="float32", page_size=PAGE)
    ours, ref = BatchInvariantMLAAttention(request), TorchMLAAttention(request)
    cache, tables = _fill(ours, [9, 70], (), 11)
    q = torch.randn(4, 3, 24, generator=torch.Generator().manual_seed(2))
    meta = _meta(tables, [9, 70], [1, 3])
    out = ours.forward(q, cache, meta, 0.2)
    torch.testing.assert_close(out, ref.forward(q, cache, meta, 0.2), atol=2e-5, rtol=2e-5)
    alone = ours.forward(q[2:3], cache, _meta(tables[1:], [69], [1]), 0.2)
    assert torch.equal(alone[0], out[2])


def test_verdicts() -> None:
    gqa = AttentionRequest("gqa", 8, 2, 128)
    assert BatchInvariantPagedAttention.can_implement(gqa, parse_device("sm_90")).accepted
    cpu = BatchInvariantPagedAttention.can_implement(gqa, parse_device("cpu"))
    assert not cpu.accepted and "device platform is 'cpu'" in cpu.reason
    mla = AttentionRequest("mla", 16, 1, 192, 128, 512, 64)
    assert BatchInvariantMLAAttention.can_implement(mla, parse_device("sm_90")).accepted
    assert not BatchInvariantPagedAttention.can_implement(mla, parse_device("sm_90")).applicable


def test_split_size_depends_on_the_head_dim_only() -> None:
    from kernelbay_batch_invariant.attention import split_size

    assert [split_size(d) for d in (8, 64, 128, 129, 192, 576, 4096)] == [64, 64, 64, 32, 32,
                                                                          16, 16]
