"""The engine hands attention backends host copies of the tables they need on the host, so
that a step's kernels queue without a device round trip per layer."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine_helpers import save_tiny
from kernelbay import Policy, Registry
from kernelbay.engine import LLM, SamplingParams
from kernelbay.engine.transfer import upload, upload_into
from kernelbay.layers import AttentionMetadata
from kernelbay.layers.torch_attention import TorchPagedAttention
from kernelbay.requests import AttentionRequest
from kernelbay.testing.capture import simulated_capture

CORE_ONLY = Registry(Policy(plugins=frozenset()))


def test_every_step_carries_host_copies_equal_to_its_tables(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[AttentionMetadata] = []
    forward = TorchPagedAttention.forward

    def spy(self: TorchPagedAttention, query: torch.Tensor, cache: torch.Tensor,
            metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        seen.append(metadata)
        return forward(self, query, cache, metadata, scale)

    monkeypatch.setattr(TorchPagedAttention, "forward", spy)
    llm = LLM(save_tiny(str(tmp_path), "llama"), dtype="float32", registry=CORE_ONLY,
              max_num_seqs=4)
    llm.generate([[5, 6, 7], [8, 9], [10, 11, 12, 13, 14]],
                 SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(seen) > 4
    for meta in seen:
        assert meta.query_start_host is not None and meta.seq_lens_host is not None
        assert list(meta.query_start_host) == meta.query_start_loc.tolist()
        assert list(meta.seq_lens_host) == meta.seq_lens.tolist()


def _metadata(starts: torch.Tensor, lengths: list[int], page: int) -> AttentionMetadata:
    tables = torch.arange(len(lengths) * 4, dtype=torch.int32).view(len(lengths), 4)
    return AttentionMetadata(starts, torch.tensor(lengths, dtype=torch.int32), tables,
                             torch.zeros(len(lengths), dtype=torch.long))


@pytest.mark.parametrize("new", [[1, 1, 1], [2, 1, 3]])
def test_torch_attention_takes_the_host_copies_without_reading_the_tensors(
        new: list[int]) -> None:
    """Decode and mixed batches give the same output whether the query starts and lengths
    are read from the tensors or from the host copies, and with the host copies nothing is
    read back to the host (a simulated capture raises on any such read)."""
    request = AttentionRequest("gqa", 4, 2, 8, page_size=4)
    backend = TorchPagedAttention(request)
    cache = torch.randn(12, 2, 4, 2, 8)
    lengths = [5, 9, 13]
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(sum(new), 4, 8, generator=gen)
    starts = [0]
    for n in new:
        starts.append(starts[-1] + n)
    plain = _metadata(torch.tensor(starts, dtype=torch.int32), lengths, 4)
    want = backend.forward(query, cache, plain, 0.3)
    hosted = _metadata(torch.tensor(starts, dtype=torch.int32), lengths, 4)
    hosted.query_start_host = tuple(starts)
    hosted.seq_lens_host = tuple(lengths)
    with simulated_capture():
        got = backend.forward(query, cache, hosted, 0.3)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_upload_gives_the_values_with_the_dtype() -> None:
    out = upload([[1, 2], [3, 4]], torch.int32, torch.device("cpu"))
    assert out.dtype == torch.int32 and out.tolist() == [[1, 2], [3, 4]]
    upload_into(out, [[5, 6], [7, 8]])
    assert out.dtype == torch.int32 and out.tolist() == [[5, 6], [7, 8]]
