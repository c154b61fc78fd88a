"""Batch-invariant matmul (kernelbay-batch-invariant) against cuBLAS (torch.matmul), bf16.

For each (N, K) in {4096x4096, 14336x4096, 4096x14336} and M in {1, 16, 64, 128, 256, 1024}:
time of ``invariant_matmul`` and of ``torch.matmul`` (the baseline, same inputs, same run),
their ratio (target: at most 1.3x at M >= 64), and, once per shape before timing, the
correctness check against torch and the bitwise check: the rows of the result for
M = 1..256 equal the first rows of the M = 256 result. Any failed check exits non-zero.

    python bench/batch_invariant/run.py --out DIR        # about 1 minute on an H200

Timing (``--timer graph``, the default): ``triton.testing.do_bench_cudagraph`` (median) of a
CUDA graph of many calls, each on the next of several weight copies whose total exceeds
twice the L2 (so every call reads its weight from HBM, as in a model); the same for both
sides. A graph takes the host's launch work out of both times: the split configs launch two
kernels and build tensor descriptors per call, which plain event timing charges to them
whenever the host falls behind the GPU. ``--timer events`` is ``triton.testing.do_bench``
(L2 flushed before each call, host launch work included when the GPU waits for it).

``--configs all`` also times every tiling in ``SHAPE_CANDIDATES`` (tile sizes, warps, stages and
a fixed split-K; each a function of N and K only, so any of them keeps the rows invariant;
each is bitwise-checked for M = 1..256 before it is timed) and names the best per shape (the
smallest worst ratio at M >= 64, then the smallest geometric mean), with the
``configs.TABLE`` line to paste. ``--budget`` (default 95 s) caps the whole run: each shape's
sweep stops at its share of it and lists the candidates it did not try, so the run ends
within about 100 s on an H200 with its results written.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]
#: L2 of the largest part this is run on (H200: 50 MB); weight copies rotate past twice it.
L2_BYTES = 50 * 1024 * 1024
BATCHES = [1, 16, 64, 128, 256, 1024]
TARGET = 1.3
#: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, split_k, sum_in_kernel, tma,
#: whole_tma, whole_stages[, whole_from[, lone_stages[, group_m]]]) tried by
#: ``--configs all``, per (N, K) (``CANDIDATES`` for any
#: other shape); the first of each list is the sweep's pick for ``configs.TABLE``.
#: The sixth sweep (graph timing; bench/results/batch_invariant-h200.md) and what the earlier
#: ones taught: N = 4096 has only 32..64 column tiles, so at M <= 128 a fixed split-K gives
#: the device enough programs, and partials summed by a second kernel beat the in-kernel sum
#: (1.21 against 1.41 at 4096 x 4096, M = 64). From as many tiles as SMs a split config runs
#: as whole tiles: one K loop with two fp32 accumulator tiles, loaded through tensor
#: descriptors (``whole_tma``: fewer registers). A tile count just under the SM count (4096 x
#: 4096 at M = 256: 128 tiles) runs faster whole, with a deeper pipeline since one block per
#: SM leaves the shared memory free (``whole_from`` 0.9, ``lone_stages`` 5: 1.21 against 1.39
#: as 512 split programs). Eight warps per whole-tile program (a field of that sweep, since
#: removed) lost at M = 1024: 1.41-1.45 against 1.26-1.27. N = 14336: 64-wide tiles unsplit.
SHAPE_CANDIDATES = {
    (4096, 4096): [(64, 128, 64, 4, 4, 4, False, False, True, 4, 0.9, 5),
                   (64, 128, 64, 4, 4, 4, False, False, True, 4, 0.9, 5, 16),
                   (64, 128, 64, 4, 4, 4, False, False, True, 4, 0.9, 5, 4),
                   (128, 64, 64, 4, 4, 4, False, False, True, 4, 0.9, 5)],
    (4096, 14336): [(128, 128, 64, 8, 4, 4, False, True, True, 4),
                    (128, 128, 64, 8, 4, 4, False, True, True, 4, 1.0, 0, 16)],
    # GROUP_M (programs sharing a W column tile in launch order) only moves tiles between
    # programs: at M = 1024 (16 row tiles) a group of 16 reads each W tile from HBM once.
    (14336, 4096): [(64, 128, 64, 4, 4, 1, False, False, True, 4, 1.0, 5, 16),
                    (64, 128, 64, 4, 4, 1, False, False, True, 4, 1.0, 5, 8),
                    (64, 128, 64, 4, 4, 1, False, False, True, 4, 1.0, 5, 32)],
}
CANDIDATES = SHAPE_CANDIDATES[(4096, 4096)]


def _check(mm, x, w, n: int, k: int) -> dict[str, object]:  # type: ignore[no-untyped-def]

    full = mm(x[:256], w)
    ref = x[:256].float() @ w.float().T
    err = (full.float() - ref).abs().max().item()
    bound = 2e-2 * ref.abs().max().item()
    if not err <= bound:
        raise SystemExit(f"N={n} K={k}: invariant matmul differs from torch by {err:.4g} "
                         f"(bound {bound:.4g})")
    _bitwise(mm, x, w, full, f"N={n} K={k}")
    return {"max_abs_err": err, "bitwise_m_1_256": True}


def _check_close(full, x, w, what: str) -> None:  # type: ignore[no-untyped-def]
    """Exit non-zero unless ``full`` matches the fp32 product within bf16 rounding."""
    ref = x.float() @ w.float().T
    err = (full.float() - ref).abs().max().item()
    bound = 2e-2 * ref.abs().max().item()
    if not err <= bound:
        raise SystemExit(f"{what}: differs from torch by {err:.4g} (bound {bound:.4g})")


def _bitwise(mm, x, w, full, what: str) -> None:  # type: ignore[no-untyped-def]
    """Exit non-zero unless the rows for M = 1..256 and M = len(x) equal those of ``full``
    (the M = 256 result)."""
    import torch

    bad = [m for m in range(1, 257) if not torch.equal(mm(x[:m], w), full[:m])]
    # and M = len(x) (1024: enough tiles that split-K runs as whole tiles, same bits)
    if not torch.equal(mm(x, w)[:256], full):
        bad.append(len(x))
    if bad:
        raise SystemExit(f"{what}: rows not bitwise identical at M={bad[:10]}")


def _pick(entries: list[dict[str, object]]) -> dict[str, object]:
    """The candidate with the smallest worst ratio at M >= 64, ties by geometric mean."""
    return min(entries, key=lambda r: (r["worst_m_ge_64"], r["geomean_m_ge_64"]))


def _describe(c: dict[str, int]) -> str:
    where = " in-kernel" if c["split_k"] > 1 and c["sum_in_kernel"] else ""
    whole = ""
    if c.get("whole_tma") or c.get("whole_stages"):
        whole = (f"; whole: {'tma ' if c.get('whole_tma') else ''}"
                 f"s{c.get('whole_stages') or c['num_stages']}")
    if c["split_k"] > 1 and c.get("whole_from", 1.0) != 1.0:
        whole += f" from {c['whole_from']:g} x SMs"
    if c.get("lone_stages"):
        whole += f", lone s{c['lone_stages']}"
    if c.get("group_m", 8) != 8:
        whole += f"; group {c['group_m']}"
    return (f"{c['block_m']}x{c['block_n']}x{c['block_k']}, {c['num_warps']}, "
            f"{c['num_stages']}, {c['split_k']}{where}{' tma' if c.get('tma') else ''}{whole}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--configs", choices=("table", "all"), default="table")
    parser.add_argument("--budget", type=float, default=95.0,
                        help="seconds for the whole run with --configs all: each shape's "
                             "sweep stops at its share, untried candidates are listed")
    parser.add_argument("--timer", choices=("graph", "events"), default="graph",
                        help="graph replays over rotated weight copies (default) or "
                             "do_bench events with an L2 flush")
    parser.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES),
                        help="NxK list to run (default: %(default)s)")
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

    def timed(fn, weights, xm, rep: int):  # type: ignore[no-untyped-def]
        """Median milliseconds of ``fn(xm, w)``, rotating over ``weights``."""
        if args.timer == "events":
            return triton.testing.do_bench(lambda: fn(xm, weights[0]), warmup=25, rep=rep)
        state = [0]

        def call():  # type: ignore[no-untyped-def]
            w = weights[state[0] % len(weights)]
            state[0] += 1
            return fn(xm, w)

        with torch.cuda.stream(torch.cuda.Stream()):
            return triton.testing.do_bench_cudagraph(call, rep=rep, return_mode="median")
    batches = [int(b) for b in args.batches.split(",")]
    device = torch.device("cuda")
    rows, checks, sweep = [], {}, []
    failed: list[str] = []
    skipped: list[str] = []
    start = time.monotonic()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]
    for index, (n, k) in enumerate(shapes):
        deadline = start + args.budget * (index + 1) / len(shapes)
        config = matmul_config(n, k, "bfloat16", device_shared_memory(device))

        def mm(a, b, config=config):  # type: ignore[no-untyped-def]
            return invariant_matmul(a, b, config)

        g = torch.Generator(device="cuda").manual_seed(n * 7 + k)
        w = (torch.randn(n, k, device=device, generator=g) * 0.02).to(torch.bfloat16)
        x = torch.randn(max([*batches, 256]), k, device=device, generator=g).to(torch.bfloat16)
        checks[f"{n}x{k}"] = {**_check(mm, x, w, n, k), "config": config.__dict__}
        print(f"N={n:5d} K={k:5d} table config: {_describe(config.__dict__)}", flush=True)
        copies = [w] + [w.clone() for _ in range(-(-2 * L2_BYTES // (n * k * 2)) - 1)]
        for m in batches:
            xm = x[:m].contiguous()
            ours = timed(mm, copies, xm, 100)
            cublas = timed(lambda a, b: torch.matmul(a, b.T), copies, xm, 100)
            rows.append({"N": n, "K": k, "M": m, "invariant_us": ours * 1e3,
                         "cublas_us": cublas * 1e3, "ratio": ours / cublas,
                         "tflops": 2 * m * n * k / (ours * 1e-3) / 1e12})
            print(f"N={n:5d} K={k:5d} M={m:5d}  invariant {ours * 1e3:8.1f} us  cuBLAS "
                  f"{cublas * 1e3:8.1f} us  ratio {ours / cublas:5.2f}", flush=True)
        if args.configs == "all":
            base = {r["M"]: r["cublas_us"] for r in rows if (r["N"], r["K"]) == (n, k)}
            # The table's own config first: its ratios here, next to the table rows above,
            # show how far the sweep's shorter timings drift.
            own = (config.block_m, config.block_n, config.block_k, config.num_warps,
                   config.num_stages, config.split_k, config.sum_in_kernel, config.tma,
                   config.whole_tma, config.whole_stages, config.whole_from,
                   config.lone_stages, config.group_m)
            listed = [(*c, *(1.0, 0, 8)[len(c) - 10:])
                      for c in SHAPE_CANDIDATES.get((n, k), CANDIDATES)]
            for cand in [own, *(c for c in listed if c != own)]:
                if time.monotonic() > deadline:
                    skipped.append(f"N={n} K={k} {cand}")
                    continue
                (*tile, split, in_kernel, tma, whole_tma, whole_stages, whole_from,
                 lone_stages, group_m) = cand
                cfg = choose_stages(MatmulConfig(*tile, split_k=split,
                                                 sum_in_kernel=in_kernel, tma=tma,
                                                 whole_tma=whole_tma,
                                                 whole_stages=whole_stages,
                                                 whole_from=whole_from,
                                                 lone_stages=lone_stages,
                                                 group_m=group_m), 2,
                                    device_shared_memory(device))
                try:  # a wrong candidate is reported and skipped; the exit status says so
                    full = invariant_matmul(x[:256], w, cfg)
                    _check_close(full, x[:256], w, f"N={n} K={k} candidate {cand}")
                    _bitwise(lambda a, b, cfg=cfg: invariant_matmul(a, b, cfg), x, w, full,
                             f"N={n} K={k} candidate {cand}")
                except (SystemExit, Exception) as exc:  # also a compile or launch error
                    why = " ".join(str(exc).split())[:300]
                    print(f"  FAILED {cand}: {why}", flush=True)
                    failed.append(f"{cand}: {why}")
                    continue
                ratios = []
                for m in batches:
                    xm = x[:m].contiguous()
                    t = timed(lambda a, b, cfg=cfg: invariant_matmul(a, b, cfg), copies, xm, 40)
                    ratios.append((m, t * 1e3 / base[m]))
                big = [r for m, r in ratios if m >= 64]
                geo = float(torch.tensor(big).log().mean().exp()) if big else float("nan")
                worst = max(big) if big else float("nan")
                sweep.append({"N": n, "K": k, "config": cfg.__dict__, "ratios": ratios,
                              "geomean_m_ge_64": geo, "worst_m_ge_64": worst,
                              "is_table": cand == own})
                print(f"  candidate {cand}: ratio at M >= 64 geomean {geo:.2f}, worst "
                      f"{worst:.2f}", flush=True)
    result = {"device": torch.cuda.get_device_name(), "dtype": "bfloat16", "target": TARGET,
              "timer": args.timer,
              "checks": checks, "rows": rows, "sweep": sweep, "failed_candidates": failed,
              "skipped_candidates": skipped, "seconds": time.monotonic() - start}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    lines = [f"# Batch-invariant matmul vs cuBLAS ({result['device']}, bf16)", "",
             "Every shape passed the torch check and the bitwise row check (M = 1..256) "
             "before timing. Timer: "
             + ("CUDA-graph replays over weight copies past 2x L2, median (both sides)."
                if args.timer == "graph" else "do_bench events, L2 flushed, median."), "",
             "| N | K | M | invariant (us) | cuBLAS (us) | ratio | TFLOP/s | <= 1.3x |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        meets = "yes" if r["ratio"] <= TARGET else ("no" if r["M"] >= 64 else "-")
        lines.append(f"| {r['N']} | {r['K']} | {r['M']} | {r['invariant_us']:.1f} | "
                     f"{r['cublas_us']:.1f} | {r['ratio']:.2f} | {r['tflops']:.1f} | {meets} |")
    if sweep:
        lines += ["", "Candidate tilings (`--configs all`; each bitwise-checked for M = 1..256 "
                  "first), ratio to cuBLAS per M:", "",
                  "| N | K | BM x BN x BK, warps, stages, split-K (sum) | " + " | ".join(
                      f"M={m}" for m in batches) + " | geomean M >= 64 | worst M >= 64 |",
                  "| --- | --- | --- | " + " | ".join("---" for _ in batches)
                  + " | --- | --- |"]
        for r in sweep:
            mark = " (table)" if r["is_table"] else ""
            lines.append(f"| {r['N']} | {r['K']} | {_describe(r['config'])}{mark} | "
                         + " | ".join(f"{v:.2f}" for _, v in r["ratios"])
                         + f" | {r['geomean_m_ge_64']:.2f} | {r['worst_m_ge_64']:.2f} |")
        lines += ["", "Best per shape (smallest worst ratio at M >= 64), as `configs.TABLE` "
                  "lines:", "", "```python"]
        for n, k in shapes:
            entries = [r for r in sweep if (r["N"], r["K"]) == (n, k)]
            if entries:
                best = _pick(entries)
                c = best["config"]
                lines.append(f"    ({n}, {k}, \"bfloat16\"): MatmulConfig({c['block_m']}, "
                             f"{c['block_n']}, {c['block_k']}, {c['num_warps']}, "
                             f"{c['num_stages']}, split_k={c['split_k']}, "
                             f"sum_in_kernel={c['sum_in_kernel']}"
                             + (", tma=True" if c.get("tma") else "")
                             + (", whole_tma=True" if c.get("whole_tma") else "")
                             + (f", whole_stages={c['whole_stages']}"
                                if c.get("whole_stages") else "")
                             + (f", whole_from={c['whole_from']:g}"
                                if c.get("whole_from", 1.0) != 1.0 else "")
                             + "".join(f", {f}={c[f]}" for f in ("lone_stages",)
                                       if c.get(f))
                             + (f", group_m={c['group_m']}" if c.get("group_m", 8) != 8
                                else "") + "),  # worst "
                             f"{best['worst_m_ge_64']:.2f}, geomean "
                             f"{best['geomean_m_ge_64']:.2f}")
        lines.append("```")
    if skipped:
        lines += ["", f"Not tried within --budget {args.budget:.0f} s:", ""]
        lines += [f"- {c}" for c in skipped]
    if failed:
        lines += ["", "Candidates that FAILED their check (not timed):", ""]
        lines += [f"- {f}" for f in failed]
    with open(os.path.join(args.out, "results.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines[lines.index("```python"):]) if sweep else "", flush=True)
    if failed:
        print(f"{len(failed)} candidate(s) failed their check", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
