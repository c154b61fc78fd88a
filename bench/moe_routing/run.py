"""Benchmark: the MoE routing grouped by expert (``kernelbay.layers.expert_blocks``), each way
it can be made, against the tensor operations in the same run.

For each routed slot count (tokens x top-k, uniform random distinct experts per token): the
tensor operations (``kernel="torch"``), the one-tile Triton program (up to ``SMALL_SLOTS``)
and the multi-program routing (any count; three launches of one program per chunk of slots),
each at several warp counts (and chunk sizes), every result checked against the tensor
operations' blocks first (a mismatch makes the script exit 1 after writing what it measured),
then replayed from a CUDA graph (microseconds). ``auto`` is what ``expert_blocks`` runs by
default.

    python bench/moe_routing/run.py --out DIR                      # about a minute, CUDA
    TRITON_INTERPRET=1 python bench/moe_routing/run.py --device cpu --slots 8,16 --out DIR
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from moe_common import uniform_routing  # from bench/, put on the path above
from report import row_line, run_record, write_results
from settle import add_timing_args, timed_us

#: (program, warps, slots per program) variants of the Triton programs; the chunk applies to
#: the multi-program routing only.
VARIANTS = (("small", 1, 0), ("small", 2, 0), ("small", 4, 0), ("small", 8, 0),
            ("multi", 4, 64), ("multi", 4, 128),
            ("multi", 8, 128), ("multi", 4, 256), ("multi", 8, 256))


def variant_key(program: str, warps: int, chunk: int) -> str:
    """The column name of one variant: ``small_w8``, ``multi_c128_w4``."""
    return f"{program}_c{chunk}_w{warps}" if program == "multi" else f"{program}_w{warps}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for results.json / results.md")
    p.add_argument("--slots", default="8,32,64,128,256,512,2048,8192",
                   help="routed slot counts (multiples of --top-k)")
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--block-m", type=int, default=16, help="rows per block")
    add_timing_args(p, rep_ms=20.0)
    args = p.parse_args(argv)
    import torch
    from kernelbay.layers.expert_blocks import expert_blocks, max_blocks
    from kernelbay.layers.expert_blocks_triton import (
        SMALL_SLOTS,
        fill_expert_blocks,
    )

    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        print("bench/moe_routing/run.py needs a CUDA GPU (or --device cpu under "
              "TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    gen = torch.Generator().manual_seed(0)
    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    E, bm = args.experts, args.block_m
    for slots_n in (int(v) for v in args.slots.split(",")):
        ids, _ = uniform_routing(slots_n // args.top_k, E, args.top_k, gen, dev)
        want = expert_blocks(ids, E, bm, kernel="torch")
        auto = expert_blocks(ids, E, bm)
        if not (torch.equal(auto.slots, want.slots) and torch.equal(auto.experts, want.experts)):
            failures.append(f"auto at {ids.numel()} slots: blocks differ from the tensor "
                            "operations'")
        row: dict[str, Any] = {"slots": ids.numel()}
        row["torch_us"] = timed_us(lambda ids=ids: expert_blocks(ids, E, bm, kernel="torch"),
                                   dev, settle_s=args.settle_s, rep_ms=args.rep_ms)
        row["auto_us"] = timed_us(lambda ids=ids: expert_blocks(ids, E, bm), dev,
                                  settle_s=args.settle_s, rep_ms=args.rep_ms)
        blocks = max_blocks(ids.numel(), E, bm)
        for program, warps, chunk in VARIANTS:
            if program == "small" and ids.numel() > SMALL_SLOTS:
                continue
            slots = torch.empty(blocks * bm, dtype=torch.int32, device=dev)
            owners = torch.empty(blocks, dtype=torch.int32, device=dev)

            def run(ids: torch.Tensor = ids, slots: torch.Tensor = slots,
                    owners: torch.Tensor = owners, program: str = program,
                    warps: int = warps, chunk: int = chunk) -> None:
                fill_expert_blocks(ids, E, bm, slots, owners, program=program, num_warps=warps,
                                   **({"chunk": chunk} if chunk else {}))

            run()
            key = variant_key(program, warps, chunk)
            if not (torch.equal(slots, want.slots) and torch.equal(owners, want.experts)):
                failures.append(f"{key} at {ids.numel()} slots: blocks differ from the tensor "
                                "operations'")
                continue
            row[f"{key}_us"] = timed_us(run, dev, settle_s=args.settle_s, rep_ms=args.rep_ms)
        rows.append(row)
        print(row_line(row), flush=True)
    result = run_record("MoE routing grouped by expert", dev, experts=E, top_k=args.top_k,
                        block_m=bm, rows=rows, failures=failures)
    return write_results(args.out, result, markdown(result), failures)


def markdown(result: dict[str, Any]) -> str:
    """One row per slot count, one column per way (us, CUDA-graph replays)."""
    keys = ["torch_us", "auto_us"] + [f"{variant_key(*v)}_us" for v in VARIANTS]
    lines = [f"# MoE routing grouped by expert ({result['device']})", "",
             f"{result['date']}, torch {result['torch']}, triton {result['triton']}; "
             f"{result['experts']} experts, top-{result['top_k']}, {result['block_m']}-row "
             "blocks, uniform random routing; microseconds per call replayed from a CUDA graph; "
             "`small_wN`: the one-tile program with N warps, "
             "`multi_cC_wN`: the multi-program routing with C slots and N warps per program, "
             "`auto` "
             "what `expert_blocks` runs; - where a program does not take that many slots. "
             "`python bench/moe_routing/run.py`.", "",
             "| slots | " + " | ".join(k.removesuffix("_us") for k in keys) + " |",
             "| ---: |" + " ---: |" * len(keys)]
    for r in result["rows"]:
        lines.append(f"| {r['slots']} | " + " | ".join(
            f"{r[k]:.1f}" if k in r else "-" for k in keys) + " |")
    if result["failures"]:
        lines += ["", "Wrong results:", *[f"- {f}" for f in result["failures"]]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
