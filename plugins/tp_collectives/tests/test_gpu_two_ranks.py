"""On a host with two CUDA GPUs (NCCL): the symmetric-memory all-reduce (one-shot, two-shot
written back into the input, the padded two-shot, NCCL beyond the buffer) equals NCCL's for
sizes from a few elements to 128 MB, its GEMM into the buffer equals GEMM then NCCL, and the fused candidate on this host (multicast switched off)
falls back with one warning and the right sums."""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu


def _worker(rank: int, port: int, results: dict[int, Any]) -> None:
    import torch.distributed as dist
    from kernelbay import CollectiveRequest
    from kernelbay_tp_collectives.fused import FusedGemmAllReduce
    from kernelbay_tp_collectives.two_shot import SymmMemTwoShotAllReduce

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2)
    try:
        two_shot = SymmMemTwoShotAllReduce(CollectiveRequest("all_reduce", 2, "bfloat16",
                                                             "nccl"))
        g = torch.Generator(device="cuda").manual_seed(rank)
        worst = 0.0
        paths = set()
        for numel in (8, 1000, 4096, 200002, 1 << 20, 32 << 20):
            for dtype in (torch.bfloat16, torch.float32):
                x = torch.randn(numel, device="cuda", generator=g).to(dtype)
                ref = x.clone()
                dist.all_reduce(ref)
                paths.add(two_shot.path(x))
                got = two_shot.all_reduce(x.clone())
                worst = max(worst, (got.float() - ref.float()).abs().max().item())
        x = torch.randn(64, 1024, device="cuda", generator=g).to(torch.bfloat16)
        w = torch.randn(512, 1024, device="cuda", generator=g).to(torch.bfloat16)
        ref = torch.nn.functional.linear(x, w)
        dist.all_reduce(ref)
        into = two_shot.gemm_all_reduce(x, w)  # cuBLAS may tile mm(out=) differently
        gemm_ok = torch.allclose(into.float(), ref.float(), rtol=1e-2,
                                 atol=1e-2 * ref.abs().max().item())
        fused = FusedGemmAllReduce(CollectiveRequest("gemm_all_reduce", 2, "bfloat16", "nccl"))
        x = torch.randn(16, 512, device="cuda", generator=g).to(torch.bfloat16)
        w = torch.randn(256, 512, device="cuda", generator=g).to(torch.bfloat16)
        ref = torch.nn.functional.linear(x, w)
        dist.all_reduce(ref)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            outs = [fused.gemm_all_reduce(x, w) for _ in range(3)]
        results[rank] = {"worst": worst, "paths": sorted(paths), "gemm_ok": gemm_ok,
                         "broken": two_shot._broken, "warnings": [str(c.message) for c in caught],
                         "fused_ok": all(torch.equal(o, ref) for o in outs),
                         "fell_back": fused.fell_back}
    finally:
        dist.destroy_process_group()


def test_two_ranks_over_nccl() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs, found {torch.cuda.device_count()}")
    import torch.multiprocessing as mp
    from engine_helpers import free_port

    results = mp.Manager().dict()
    mp.spawn(_worker, args=(free_port(), results), nprocs=2, join=True)
    for rank in (0, 1):
        r = results[rank]
        assert r["worst"] <= 0.0625, r  # bf16 rounding of a sum of two normals
        assert r["paths"] == ["nccl", "one_shot", "two_shot"] and not r["broken"], r
        assert r["gemm_ok"], r
        assert r["fell_back"] and r["fused_ok"]
        assert len(r["warnings"]) == 1 and "TORCH_SYMM_MEM_DISABLE_MULTICAST=1" in \
            r["warnings"][0]
