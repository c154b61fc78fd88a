"""Under gloo with two processes: the fused collective falls back to GEMM, then all-reduce,
with one warning; the two-shot collective sums CPU tensors through torch.distributed."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from engine_helpers import free_port
from kernelbay import CollectiveRequest


def _inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(5, 12, generator=g), torch.randn(8, 12, generator=g)


def _worker(rank: int, port: int, switch: bool, results: dict[int, object]) -> None:
    from kernelbay_tp_collectives.fused import FusedGemmAllReduce
    from kernelbay_tp_collectives.two_shot import SymmMemTwoShotAllReduce

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if switch:
        os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    else:
        os.environ.pop("TORCH_SYMM_MEM_DISABLE_MULTICAST", None)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        fused = FusedGemmAllReduce(CollectiveRequest("gemm_all_reduce", 2, "float32", "gloo"))
        two_shot = SymmMemTwoShotAllReduce(CollectiveRequest("all_reduce", 2, "float32",
                                                             "gloo"))
        x, w = _inputs(rank)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            outs = [fused.gemm_all_reduce(x, w) for _ in range(3)]
        summed = two_shot.all_reduce(x.clone())
        results[rank] = {"outs": outs, "warnings": [str(c.message) for c in caught],
                         "fell_back": fused.fell_back, "summed": summed}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("switch", [False, True])
def test_fused_falls_back_with_one_warning(switch: bool) -> None:
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(free_port(), switch, results), nprocs=2, join=True)
    (x0, w0), (x1, w1) = _inputs(0), _inputs(1)
    expected = x0 @ w0.T + x1 @ w1.T
    for rank in (0, 1):
        r = results[rank]
        assert r["fell_back"]
        assert len(r["warnings"]) == 1, r["warnings"]
        assert "running GEMM, then all-reduce" in r["warnings"][0]
        if switch:
            assert "TORCH_SYMM_MEM_DISABLE_MULTICAST=1" in r["warnings"][0]
        for out in r["outs"]:
            torch.testing.assert_close(out, expected)
        assert torch.equal(r["summed"], x0 + x1)
