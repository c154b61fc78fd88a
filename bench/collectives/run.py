"""All-reduce bandwidth on two GPUs: NCCL (``torch.distributed``, the reference) against
kernelbay-tp-collectives' symmetric-memory two-shot all-reduce, for 4 KB .. 64 MB of bf16,
and the fused GEMM + all-reduce candidate's fallback (GEMM, then all-reduce) on a
row-parallel shape. Every result is checked against NCCL's once before timing (non-zero exit
on a mismatch). Rank 0 writes results.json and results.md to --out.

    torchrun --nproc-per-node 2 bench/collectives/run.py --out DIR    # about 1 minute
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
GEMM_M = [1, 16, 128, 1024]
GEMM_NK = (8192, 14336)  # a 70B-class down_proj, K split over two ranks: 28672 / 2


def _time_ms(fn, iters: int) -> float:  # type: ignore[no-untyped-def]
    """Mean milliseconds of ``fn`` over ``iters`` calls, the slowest rank's."""
    import torch
    import torch.distributed as dist

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    t = torch.tensor([start.elapsed_time(end) / iters], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _size_text(n: int) -> str:
    return f"{n >> 20} MB" if n >= 1 << 20 else f"{n >> 10} KB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from kernelbay import CollectiveRequest
    from kernelbay.device import probe_device
    from kernelbay_tp_collectives.fused import FusedGemmAllReduce
    from kernelbay_tp_collectives.two_shot import SymmMemTwoShotAllReduce

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = probe_device(local)
    request = CollectiveRequest("all_reduce", world, "bfloat16", "nccl")
    verdict = SymmMemTwoShotAllReduce.can_implement(request, device)
    two_shot = SymmMemTwoShotAllReduce(request)
    gemm_request = CollectiveRequest("gemm_all_reduce", world, "bfloat16", "nccl")
    fused_verdict = FusedGemmAllReduce.can_implement(gemm_request, device)
    fused = FusedGemmAllReduce(gemm_request)
    g = torch.Generator(device="cuda").manual_seed(1234 + rank)
    rows, gemm_rows = [], []
    for size in SIZES:
        x = torch.randn(size // 2, device="cuda", generator=g).to(torch.bfloat16)
        expected = x.clone()
        dist.all_reduce(expected)
        got = two_shot.all_reduce(x.clone())
        if not torch.allclose(got.float(), expected.float(), atol=2e-2, rtol=2e-2):
            raise SystemExit(f"rank {rank}: two-shot all-reduce of {size} bytes differs from "
                             f"NCCL by {(got.float() - expected.float()).abs().max():.4g}")
        work = x.clone()
        nccl_ms = _time_ms(lambda w=work: dist.all_reduce(w), args.iters)
        ours_ms = _time_ms(lambda w=work: two_shot.all_reduce(w), args.iters)
        bus = 2 * (world - 1) / world * size
        rows.append({"bytes": size, "nccl_us": nccl_ms * 1e3, "two_shot_us": ours_ms * 1e3,
                     "nccl_busbw_gbs": bus / (nccl_ms * 1e-3) / 1e9,
                     "two_shot_busbw_gbs": bus / (ours_ms * 1e-3) / 1e9,
                     "speedup": nccl_ms / ours_ms})
    n, k = GEMM_NK
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for m in GEMM_M:
            x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
            ref = F.linear(x, w)
            dist.all_reduce(ref)
            out = fused.gemm_all_reduce(x, w)
            if not torch.allclose(out.float(), ref.float(), atol=5e-2, rtol=2e-2):
                raise SystemExit(f"rank {rank}: GEMM + all-reduce (M={m}) differs from the "
                                 "reference")
            y = F.linear(x, w)
            gemm_ms = _time_ms(lambda x=x: F.linear(x, w), args.iters)
            reduce_ms = _time_ms(lambda y=y: dist.all_reduce(y), args.iters)
            path_ms = _time_ms(lambda x=x: fused.gemm_all_reduce(x, w), args.iters)
            gemm_rows.append({"M": m, "N": n, "K": k, "gemm_us": gemm_ms * 1e3,
                              "all_reduce_us": reduce_ms * 1e3,
                              "fallback_path_us": path_ms * 1e3})
    if rank == 0:
        result = {"device": torch.cuda.get_device_name(), "world_size": world,
                  "device_facts": device.as_dict(),
                  "two_shot_verdict": verdict.reason if not verdict.accepted else "accepted",
                  "fused_verdict": (fused_verdict.reason if not fused_verdict.accepted
                                    else "accepted"),
                  "fused_fell_back": fused.fell_back,
                  # only the fallback's own warnings (torch's barrier notes are not ours)
                  "fused_warnings": [str(c.message) for c in caught
                                     if str(c.message).startswith("tp-fused-gemm-all-reduce")],
                  "all_reduce": rows, "gemm_all_reduce": gemm_rows}
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
        lines = [f"# All-reduce on {world} x {result['device']} (bf16)", "",
                 f"- tp-symm-mem-two-shot verdict on this machine: {result['two_shot_verdict']}",
                 f"- tp-fused-gemm-all-reduce verdict: {result['fused_verdict']}",
                 f"- fused instance fell back: {fused.fell_back}; warnings: "
                 f"{len(result['fused_warnings'])}", "",
                 "| size | NCCL (us) | two-shot (us) | NCCL busbw (GB/s) | two-shot busbw (GB/s) "
                 "| speedup vs NCCL |", "| --- | --- | --- | --- | --- | --- |"]
        for r in rows:
            lines.append(f"| {_size_text(r['bytes'])} | {r['nccl_us']:.1f} | "
                         f"{r['two_shot_us']:.1f} | {r['nccl_busbw_gbs']:.1f} | "
                         f"{r['two_shot_busbw_gbs']:.1f} | {r['speedup']:.2f} |")
        lines += ["", f"GEMM + all-reduce, N={n}, K={k} per rank (fallback: GEMM, then "
                  "all-reduce):", "",
                  "| M | GEMM (us) | all-reduce (us) | fallback path (us) |",
                  "| --- | --- | --- | --- |"]
        for r in gemm_rows:
            lines.append(f"| {r['M']} | {r['gemm_us']:.1f} | {r['all_reduce_us']:.1f} | "
                         f"{r['fallback_path_us']:.1f} |")
        with open(os.path.join(args.out, "results.md"), "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
        print("\n".join(lines))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
