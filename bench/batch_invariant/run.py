"""Batch-invariant matmul (kernelbay-batch-invariant) against cuBLAS (torch.matmul), bf16.

For each (N, K) in {4096x4096, 14336x4096, 4096x14336} and M in {1, 16, 64, 128, 256, 1024}:
time of ``invariant_matmul`` and of ``torch.matmul`` (the baseline, same inputs, same run),
their ratio (target: at most 1.3x at M >= 64), and, once per shape before timing, the
correctness check against torch and the bitwise check: the rows of the result for
M = 1..256 equal the first rows of the M = 256 result. Any failed check exits non-zero.

    python bench/batch_invariant/run.py --out DIR        # about 1 minute on an H200
"""

from __future__ import annotations

import argparse
import json
import os
import sys

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]
BATCHES = [1, 16, 64, 128, 256, 1024]
TARGET = 1.3


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
    args = parser.parse_args()
    import torch
    import triton.testing
    from kernelbay_batch_invariant.configs import device_shared_memory, matmul_config
    from kernelbay_batch_invariant.kernels import invariant_matmul

    if not torch.cuda.is_available():
        raise SystemExit("bench/batch_invariant needs a CUDA GPU")
    batches = [int(b) for b in args.batches.split(",")]
    device = torch.device("cuda")
    rows, checks = [], {}
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
    result = {"device": torch.cuda.get_device_name(), "dtype": "bfloat16", "target": TARGET,
              "checks": checks, "rows": rows}
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
    with open(os.path.join(args.out, "results.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
