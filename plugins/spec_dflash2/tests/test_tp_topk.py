"""vocab_parallel_topk under gloo with two ranks equals the top-k of the whole vocabulary,
ties at the threshold included (broken by lower global id on every rank count)."""

from __future__ import annotations

import socket
from typing import Any

import pytest
import torch
from kernelbay_spec_dflash2.modules import topk_lower_id
from kernelbay_spec_dflash2.tp import merge_topk, vocab_parallel_topk

VOCAB = 37  # odd: the last rank's shard is padded


def _logits(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # Few distinct values: many ties, and ties straddling the k-th place.
    logits = torch.randint(-2, 3, (6, VOCAB), generator=gen).float()
    logits[0] = 1.0          # all tied
    logits[1, :] = -1e30     # extremes
    logits[1, 30] = 5.0
    logits[2] = torch.randn(VOCAB, generator=gen)
    return logits


def _reference(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Brute force: sort (value descending, id ascending) with Python's sort.
    values, ids = [], []
    for row in logits.tolist():
        order = sorted(range(len(row)), key=lambda i: (-row[i], i))[:k]
        values.append([row[i] for i in order])
        ids.append(order)
    return torch.tensor(values), torch.tensor(ids)


@pytest.mark.parametrize("k", [1, 5, 16, 19, 25])
def test_single_rank_is_the_lower_id_topk(k: int) -> None:
    logits = _logits(k)
    values, ids = vocab_parallel_topk(logits, k, 0, VOCAB, lambda x: x)
    want_values, want_ids = _reference(logits, k)
    assert torch.equal(ids, want_ids) and torch.equal(values, want_values)
    assert torch.equal(topk_lower_id(logits, k)[1], want_ids)


def test_merge_breaks_ties_by_lower_id() -> None:
    values = torch.tensor([[2.0, 3.0, 3.0, 2.0, 3.0]])
    ids = torch.tensor([[9, 8, 4, 1, 6]])
    v, i = merge_topk(values, ids, 4)
    assert i.tolist() == [[4, 6, 8, 1]] and v.tolist() == [[3.0, 3.0, 3.0, 2.0]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, port: int, ks: list[int], results: dict[Any, Any]) -> None:
    import torch.distributed as dist
    from kernelbay import CollectiveRequest
    from kernelbay.layers.torch_collectives import TorchDistributedCollective

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        collective = TorchDistributedCollective(CollectiveRequest("all_gather", 2, "float64",
                                                                  "gloo"))
        chunk = -(-VOCAB // 2)
        start = rank * chunk
        for k in ks:
            logits = _logits(k)
            local = torch.zeros(logits.shape[0], chunk)  # padding rows hold garbage zeros
            part = logits[:, start:start + chunk]
            local[:, :part.shape[1]] = part
            results[(rank, k)] = vocab_parallel_topk(local, k, start, VOCAB,
                                                     collective.all_gather)
    finally:
        dist.destroy_process_group()


def test_tp2_gloo_matches_tp1() -> None:
    import torch.multiprocessing as mp

    ks = [1, 5, 16, 19, 25]
    results = mp.Manager().dict()
    mp.spawn(_rank, args=(_free_port(), ks, results), nprocs=2, join=True)
    for k in ks:
        single = vocab_parallel_topk(_logits(k), k, 0, VOCAB, lambda x: x)
        for rank in (0, 1):
            values, ids = results[(rank, k)]
            assert torch.equal(ids, single[1]), (k, rank)
            assert torch.equal(values, single[0]), (k, rank)
