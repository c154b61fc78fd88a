"""Batch-invariant matmul (kernelbay-batch-invariant) against cuBLAS (torch.matmul), bf16.

For each (N, K) in {4096x4096, 14336x4096, 4096x14336} and M in {1, 16, 64, 128, 256, 1024}:
time of ``invariant_matmul`` and of ``torch.matmul`` (the baseline, same inputs, same run),
their ratio (target: at most 1.3x at M >= 64), and, once per shape before timing, the
correctness check against torch and the bitwise check: the rows of the result for
M = 1..256 equal the first rows of the M = 256 result. Any failed check exits non-zero.

    python bench/batch_invariant/run.py --out DIR        # about 1 minute on an H200

``--configs all`` also times every tiling in ``CANDIDATES`` (each a function of N and K only,
so any of them keeps the rows invariant; each is bitwise-checked on a few M first) and lists
the best per shape by geometric-mean ratio at M >= 64, to retune ``configs.TABLE`` from one
GPU run (about 1 more minute).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]
BATCHES = [1, 16, 64, 128, 256, 1024]
TARGET = 1.3
#: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) tried by ``--configs all``.
CANDIDATES = [(64, 64, 64, 4, 4), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4),
              (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (64, 256, 64, 8, 3),
              (64, 32, 128, 4, 4)]


def _check(mm, x, w, n: int, k: int) -> dict[str, object]:  # type: ignore[no-untyped-def]
    import torch

    full = mm(x[:256], w)
    ref = x[:256].float() @ w.float().T
    err = (full.float() - ref).abs().max().item()
    bound = 2e-2 * ref.abs().max().item()
    if not err <= bound:
        raise SystemExit(f"N={n} K={k}: invariant matmul differs from torch by {err:.4g} "
                         f"(bound {bound:.4g})")
    bad = [m for m in range(1, 257) if not torch.equal(mm(x[:m], w), full[:m])]
    if bad:
        raise SystemExit(f"N={n} K={k}: rows not bitwise identical at M={bad[:10]}")
    return {"max_abs_err": err, "bitwise_m_1_256": True}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--configs", choices=("table", "all"), default="table")
    args = parser.parse_args()
    import torch
    import triton.testing
    from kernelbay_batch_invariant.configs import (
        MatmulConfig,
        choose_stages,
        device_shared_memory,
        matmul_config,
    )
    from kernelbay_batch_invariant.kernels import invariant_matmul

    if not torch.cuda.is_available():
        raise SystemExit("bench/batch_invariant needs a CUDA GPU")
    batches = [int(b) for b in args.batches.split(",")]
    device = torch.device("cuda")
    rows, checks, sweep = [], {}, []
    for n, k in SHAPES:
        config = matmul_config(n, k, "bfloat16", device_shared_memory(device))

        def mm(a, b, config=config):  # type: ignore[no-untyped-def]
            return invariant_matmul(a, b, config)

        g = torch.Generator(device="cuda").manual_seed(n * 7 + k)
        w = (torch.randn(n, k, device=device, generator=g) * 0.02).to(torch.bfloat16)
        x = torch.randn(max([*batches, 256]), k, device=device, generator=g).to(torch.bfloat16)
        checks[f"{n}x{k}"] = {**_check(mm, x, w, n, k), "config": config.__dict__}
        wt = w.T
        for m in batches:
            xm = x[:m].contiguous()
            ours = triton.testing.do_bench(lambda xm=xm, w=w: mm(xm, w), warmup=25, rep=100)
            cublas = triton.testing.do_bench(lambda xm=xm, wt=wt: torch.matmul(xm, wt), warmup=25,
                                             rep=100)
            rows.append({"N": n, "K": k, "M": m, "invariant_us": ours * 1e3,
                         "cublas_us": cublas * 1e3, "ratio": ours / cublas,
                         "tflops": 2 * m * n * k / (ours * 1e-3) / 1e12})
            print(f"N={n:5d} K={k:5d} M={m:5d}  invariant {ours * 1e3:8.1f} us  cuBLAS "
                  f"{cublas * 1e3:8.1f} us  ratio {ours / cublas:5.2f}", flush=True)
        if args.configs == "all":
            base = {r["M"]: r["cublas_us"] for r in rows if (r["N"], r["K"]) == (n, k)}
            for cand in CANDIDATES:
                cfg = choose_stages(MatmulConfig(*cand), 2, device_shared_memory(device))
                full = invariant_matmul(x[:256], w, cfg)
                if not all(torch.equal(invariant_matmul(x[:m], w, cfg), full[:m])
                           for m in (1, 7, 64, 255)):
                    raise SystemExit(f"N={n} K={k}: candidate {cand} is not row invariant")
                ratios = []
                for m in batches:
                    xm = x[:m].contiguous()
                    t = triton.testing.do_bench(lambda xm=xm, cfg=cfg, w=w:
                                                invariant_matmul(xm, w, cfg), warmup=10, rep=50)
                    ratios.append((m, t * 1e3 / base[m]))
                big = [r for m, r in ratios if m >= 64]
                geo = float(torch.tensor(big).log().mean().exp()) if big else float("nan")
                sweep.append({"N": n, "K": k, "config": cfg.__dict__, "ratios": ratios,
                              "geomean_m_ge_64": geo})
                print(f"  candidate {cand}: geomean ratio (M >= 64) {geo:.2f}", flush=True)
    result = {"device": torch.cuda.get_device_name(), "dtype": "bfloat16", "target": TARGET,
              "checks": checks, "rows": rows, "sweep": sweep}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    lines = [f"# Batch-invariant matmul vs cuBLAS ({result['device']}, bf16)", "",
             "Every shape passed the torch check and the bitwise row check (M = 1..256) "
             "before timing.", "",
             "| N | K | M | invariant (us) | cuBLAS (us) | ratio | TFLOP/s | <= 1.3x |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        meets = "yes" if r["ratio"] <= TARGET else ("no" if r["M"] >= 64 else "-")
        lines.append(f"| {r['N']} | {r['K']} | {r['M']} | {r['invariant_us']:.1f} | "
                     f"{r['cublas_us']:.1f} | {r['ratio']:.2f} | {r['tflops']:.1f} | {meets} |")
    if sweep:
        lines += ["", "Candidate tilings (`--configs all`), ratio to cuBLAS per M:", "",
                  "| N | K | BM x BN x BK, warps, stages | " + " | ".join(
                      f"M={m}" for m in batches) + " | geomean M >= 64 |",
                  "| --- | --- | --- | " + " | ".join("---" for _ in batches) + " | --- |"]
        for r in sweep:
            c = r["config"]
            lines.append(f"| {r['N']} | {r['K']} | {c['block_m']}x{c['block_n']}x"
                         f"{c['block_k']}, {c['num_warps']}, {c['num_stages']} | "
                         + " | ".join(f"{v:.2f}" for _, v in r["ratios"])
                         + f" | {r['geomean_m_ge_64']:.2f} |")
    with open(os.path.join(args.out, "results.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
