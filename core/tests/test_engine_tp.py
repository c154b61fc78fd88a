"""Tensor parallel over gloo with two processes gives the same greedy tokens as one."""

from __future__ import annotations

import os
import socket

import pytest
import torch.multiprocessing as mp
from engine_helpers import save_tiny
from kernelbay import Policy, Registry
from kernelbay.engine import LLM, SamplingParams

PROMPTS = [[1, 17, 42, 99, 5], [1, 3, 3, 3, 3, 3, 8, 150]]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, path: str, port: int, results: dict[int, list[list[int]]]) -> None:
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        llm = LLM(path, dtype="float32", tensor_parallel_size=2,
                  registry=Registry(Policy(plugins=frozenset())))
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=16, ignore_eos=True))
        results[rank] = [o.token_ids for o in outs]
        assert llm.plan.collective is not None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize("family, extra", [("llama", {}), ("qwen2", {"vocab_size": 163})])
def test_tp2_gloo_matches_tp1(tmp_path: object, family: str, extra: dict[str, int]) -> None:
    path = save_tiny(os.path.join(str(tmp_path), family), family, **extra)
    single = LLM(path, dtype="float32", registry=Registry(Policy(plugins=frozenset())))
    expected = [o.token_ids for o in single.generate(
        PROMPTS, SamplingParams(max_tokens=16, ignore_eos=True))]
    results = mp.Manager().dict()
    mp.spawn(_rank, args=(path, _port(), results), nprocs=2, join=True)
    assert results[0] == expected and results[1] == expected
