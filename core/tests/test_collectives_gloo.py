"""torch.distributed collectives under gloo with two processes."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from engine_helpers import free_port
from kernelbay import CollectiveRequest
from kernelbay.layers.torch_collectives import TorchDistributedCollective


def _worker(rank: int, port: int, results: dict[int, dict[str, torch.Tensor]]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        coll = TorchDistributedCollective(CollectiveRequest("all_reduce", 2, "float32", "gloo"))
        x = torch.arange(8, dtype=torch.float32).reshape(2, 4) * (rank + 1)
        w = torch.full((3, 4), float(rank + 1))
        results[rank] = {
            "all_reduce": coll.all_reduce(x.clone()),
            "all_gather": coll.all_gather(x, dim=-1),
            "reduce_scatter": coll.reduce_scatter(x, dim=-1),
            "gemm_all_reduce": coll.gemm_all_reduce(x, w),
        }
    finally:
        dist.destroy_process_group()


def test_collectives_over_two_gloo_ranks() -> None:
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_worker, args=(free_port(), results), nprocs=2, join=True)
    x0 = torch.arange(8, dtype=torch.float32).reshape(2, 4)
    x1 = x0 * 2
    w0, w1 = torch.full((3, 4), 1.0), torch.full((3, 4), 2.0)
    for rank in (0, 1):
        r = results[rank]
        assert torch.equal(r["all_reduce"], x0 + x1)
        assert torch.equal(r["all_gather"], torch.cat([x0, x1], dim=-1))
        assert torch.equal(r["reduce_scatter"], (x0 + x1).chunk(2, dim=-1)[rank])
        torch.testing.assert_close(r["gemm_all_reduce"], x0 @ w0.T + x1 @ w1.T)
