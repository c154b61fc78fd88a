"""Benchmark: where the MoE slot sum (``kernelbay.layers.slot_sum``) should let the next
programmatic launch start, against plain launches in the same run.

For each token count, the slot sum of DeepSeek-V3's layer (top-8, hidden 7168) released at
its start, after its loads (the default) or after its store, and built without programmatic
launches (``KERNELBAY_PDL=0`` for that variant only), each result checked bit for bit against
the tensor operations first. Timed two ways as CUDA-graph replays (microseconds per call):
back to back (each sum a programmatic dependent of the one before), and followed by a dense
MXFP4 projection of the sum (kernelbay-quant-mxfp4-rocm's GEMM, hidden -> N, as a latent
MoE's output projection follows its routed sum; skipped without that plugin), the
projection alone beside it.

    python bench/moe_routing/slot_sum_release.py --out DIR      # under a minute, CUDA
    TRITON_INTERPRET=1 python bench/moe_routing/slot_sum_release.py --device cpu \
        --tokens 2 --hidden 64 --next-n 32 --out DIR             # the script's logic only
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from report import row_line, run_record, write_results  # from bench/, put on the path above
from settle import add_timing_args, timed_us

#: The variants: a release point of ``slot_sum_triton.RELEASE_POINTS``, or plain launches.
VARIANTS = ("start", "loads", "end", "plain")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for results.json / results.md")
    p.add_argument("--tokens", default="1,16,128", help="token counts")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--next-n", default="2048,7168",
                   help="output widths of the MXFP4 projection that follows the sum")
    add_timing_args(p, rep_ms=20.0)
    args = p.parse_args(argv)
    import torch
    from kernelbay.layers.slot_sum import sum_slots
    from kernelbay.layers.slot_sum_triton import sum_slots_triton

    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        print("bench/moe_routing/slot_sum_release.py needs a CUDA GPU (or --device cpu under "
              "TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    try:
        from kernelbay_quant_mxfp4_rocm.triton_gemm import mxfp4_gemm
    except ImportError:
        mxfp4_gemm = None
    K, H = args.top_k, args.hidden
    pdl_env = os.environ.get("KERNELBAY_PDL")
    gen = torch.Generator(device=dev).manual_seed(0)

    def with_variant(variant: str, fn: Any) -> Any:
        # plain: the kernel built and launched without PDL (read per call), the rest as set
        def call() -> Any:
            if variant == "plain":
                os.environ["KERNELBAY_PDL"] = "0"
            try:
                return fn("loads" if variant == "plain" else variant)
            finally:
                if pdl_env is None:
                    os.environ.pop("KERNELBAY_PDL", None)
                else:
                    os.environ["KERNELBAY_PDL"] = pdl_env
        return call

    def timed(fn: Any) -> float:
        return timed_us(fn, dev, settle_s=args.settle_s, rep_ms=args.rep_ms)

    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    for t in (int(v) for v in args.tokens.split(",")):
        y = torch.randn(t * K, H, generator=gen, device=dev)
        want = sum_slots(y, K, torch.bfloat16, kernel="torch").view(torch.int16)
        row: dict[str, Any] = {"tokens": t}
        for variant in VARIANTS:
            run = with_variant(variant, lambda rel, y=y: sum_slots_triton(
                y, K, torch.bfloat16, release=rel))
            if not torch.equal(run().view(torch.int16), want):
                failures.append(f"{variant} at {t} tokens: bits differ from the tensor sum")
                continue
            row[f"self_{variant}_us"] = timed(run)
        if mxfp4_gemm is not None:
            for n in (int(v) for v in args.next_n.split(",")):
                w = torch.randint(0, 256, (n, H // 2), dtype=torch.uint8, device=dev,
                                  generator=gen)
                s = torch.randint(118, 128, (n, H // 32), dtype=torch.uint8, device=dev,
                                  generator=gen)
                x = torch.randn(t, H, generator=gen, device=dev).bfloat16()
                row[f"n{n}_alone_us"] = timed(lambda x=x, w=w, s=s: mxfp4_gemm(
                    x, w, s, scale_max=127))
                for variant in VARIANTS:
                    run = with_variant(variant, lambda rel, y=y, w=w, s=s: mxfp4_gemm(
                        sum_slots_triton(y, K, torch.bfloat16, release=rel), w, s,
                        scale_max=127))
                    row[f"n{n}_{variant}_us"] = timed(run)
        rows.append(row)
        print(row_line(row), flush=True)
    result = run_record("MoE slot sum release point", dev, top_k=K, hidden=H,
                        next_n=args.next_n, rows=rows, failures=failures)
    return write_results(args.out, result, markdown(result), failures)


def markdown(result: dict[str, Any]) -> str:
    """One row per (token count, what follows the sum), one column per variant."""
    lines = [f"# MoE slot sum: where it releases the next launch ({result['device']})", "",
             f"{result['date']}, torch {result['torch']}, triton {result['triton']}; "
             f"top-{result['top_k']}, hidden {result['hidden']}; microseconds per call "
             "replayed from a CUDA graph. `start` / `loads` / `end`: the sum built as a "
             "programmatic launch that lets the next one start at its start, after its loads "
             "or after its store; `plain`: the sum (and the projection after it) built and "
             "launched without. `self`: sums back to back; `then N`: each sum followed by a "
             "dense MXFP4 projection hidden -> N (its time alone beside). "
             "`python bench/moe_routing/slot_sum_release.py`.", "",
             "| tokens | after the sum | " + " | ".join(VARIANTS) + " | projection alone |",
             "| ---: | --- |" + " ---: |" * (len(VARIANTS) + 1)]
    for r in result["rows"]:
        groups = [("self", "sums back to back", None)]
        groups += [(f"n{n}", f"then {n}", f"n{n}_alone_us")
                   for n in result["next_n"].split(",") if f"n{n}_alone_us" in r]
        for prefix, label, alone in groups:
            cells = [f"{r[k]:.1f}" if (k := f"{prefix}_{v}_us") in r else "-"
                     for v in VARIANTS]
            lines.append(f"| {r['tokens']} | {label} | " + " | ".join(cells) + " | "
                         + (f"{r[alone]:.1f}" if alone else "-") + " |")
    if result["failures"]:
        lines += ["", "Wrong results:", *[f"- {f}" for f in result["failures"]]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
