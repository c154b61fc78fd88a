"""Benchmark: NVFP4 routed experts (kernelbay-quant-nvfp4's ``nvfp4-moe-triton``: the routing
grouped by expert on the device, then two grouped GEMMs) against bf16 experts, in the same
run.

One MoE layer of the DeepSeek-V3 family by default (256 experts, top-8, hidden 7168, expert
intermediate 2048; ``--inter 256`` is a tensor-parallel-8 shard), T tokens routed uniformly
at random (distinct experts per token, fixed seed). The bf16 weights are the NVFP4 ones
dequantized, so all paths compute the same function:

* ``bf16 per-expert``: one ``F.linear`` per projection and routed expert, the routing read on
  the host (``kernelbay.layers.moe.swiglu_experts``: the core's ``torch-moe`` path); timed
  eagerly with CUDA events (``triton.testing.do_bench``, launches included): it cannot be
  captured;
* ``bf16 grouped``: torch's grouped GEMM (``torch._grouped_mm``) over the slots sorted by
  expert, replayed from a CUDA graph (skipped with a note where torch lacks it);
* ``nvfp4 grouped``: ``Nvfp4MoETriton.apply_moe``, eagerly (events) and replayed from a CUDA
  graph, as a captured decode step runs it.

``x bf16 grouped`` = bf16 grouped time / nvfp4 grouped time, both from graphs. Weight bandwidth
counts the bytes of the distinct experts the routing selects (NVFP4: codes + E4M3 scales) over
the nvfp4 graph time. ``--configs`` adds the two grouped GEMMs alone (routing made beforehand)
under other launch shapes, and the parts table times the routing alone both ways.

Correctness: both grouped results are checked against ``bf16 per-expert`` to 2^-5 of the
output's scale (its largest magnitude) (the NVFP4 kernels keep float32 between SiLU and the store, torch rounds each
GEMM to bf16), far below what a wrong expert, scale or routing weight gives; a mismatch makes
the script exit 1 after writing what it measured.

    python bench/nvfp4/moe.py --out bench/results/nvfp4-moe-h200        # about 2 minutes
"""

from __future__ import annotations

import argparse
import datetime
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from moe_common import (  # from bench/, put on the path above
    add_layer_args,
    bf16_baselines,
    uniform_routing,
)
from report import write_results
from settle import add_timing_args, timed_us

HERE = Path(__file__).resolve().parent


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(HERE / "moe-results"),
                   help="folder for results.json / results.md")
    add_layer_args(p)
    add_timing_args(p, rep_ms=60.0)
    p.add_argument("--configs", default="",
                   help="also time the two grouped GEMMs alone (routing made beforehand) with "
                        "each of these launch shapes, e.g. n64w4s3,n128w8s3 "
                        "(triton_grouped.GroupedConfig)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        print("bench/nvfp4/moe.py needs a CUDA GPU; torch.cuda.is_available() is False here. "
              "The CPU tests cover correctness: python -m pytest plugins/quant_nvfp4/tests",
              file=sys.stderr)
        return 2
    import triton
    from kernelbay.formats import dequantize_nvfp4, quantize_nvfp4
    from kernelbay.layers.expert_blocks import expert_blocks
    from kernelbay.layers.moe import (
        MOE_EXPERTS_ROLE,
        expert_tensor,
    )
    from kernelbay.requests import LinearRequest
    from kernelbay_quant_nvfp4.fused_moe import Nvfp4MoETriton
    from kernelbay_quant_nvfp4.schemes import nvfp4_scheme
    from kernelbay_quant_nvfp4.triton_grouped import (
        GroupedConfig,
        block_m_for,
        nvfp4_grouped_experts,
    )

    E, K, H, inter = args.experts, args.top_k, args.hidden, args.inter
    scheme = nvfp4_scheme("modelopt", w4a4=False)
    method = Nvfp4MoETriton(LinearRequest(H, inter, scheme, "bfloat16", False, MOE_EXPERTS_ROLE,
                                          num_experts=E))
    name = torch.cuda.get_device_name(0) if dev == "cuda" else "cpu (Triton interpreter)"
    gen = torch.Generator(device=dev).manual_seed(0)
    shapes = {"gate_proj": (inter, H), "up_proj": (inter, H), "down_proj": (H, inter)}
    distinct = min(args.distinct, E)
    base = {p: [quantize_nvfp4(torch.randn(*s, generator=gen, device=dev) * 0.02)
                for _ in range(distinct)] for p, s in shapes.items()}
    layer = torch.nn.Module()
    method.create_weights(layer, device=dev)
    for e in range(E):
        for p in shapes:
            packed, scales, g = base[p][e % distinct]
            for tensor, value in (("weight", packed), ("weight_scale", scales),
                                  ("weight_scale_2", g)):
                getattr(layer, expert_tensor(e, p, tensor)).data.copy_(value)
    method.process_weights_after_loading(layer)
    dense = {p: [dequantize_nvfp4(*q).bfloat16() for q in qs] for p, qs in base.items()}
    w13 = torch.stack([torch.cat([dense["gate_proj"][e % distinct],
                                  dense["up_proj"][e % distinct]]) for e in range(E)])
    w2 = torch.stack([dense["down_proj"][e % distinct] for e in range(E)])
    del dense, base
    expert_bytes = 3 * (H * inter // 2 + H * inter // 16)
    configs = [GroupedConfig.parse(c) for c in args.configs.split(",") if c]
    weights = method.stored_weights(layer)

    def timed(fn: Callable[[], Any], graph: bool = False) -> float:
        return timed_us(fn, dev, settle_s=args.settle_s, rep_ms=args.rep_ms, graph=graph)

    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    notes: set[str] = set()
    cpu_gen = torch.Generator().manual_seed(1)

    def measure(t: int) -> dict[str, Any]:
        ids, wts = uniform_routing(t, E, K, cpu_gen, dev)
        x = torch.randn(t, H, generator=gen, device=dev).bfloat16()
        check, row = bf16_baselines(x, ids, wts, w13, w2, timed, failures, notes)
        row = {"tokens": t, **row,
               "max_error": check("nvfp4 grouped", method.apply_moe(layer, x, ids, wts))}
        row["grouped_us"] = timed(lambda: method.apply_moe(layer, x, ids, wts))
        row["grouped_graph_us"] = timed(lambda: method.apply_moe(layer, x, ids, wts), True)
        row["ratio"] = row["bf16_us"] / row["grouped_us"]
        row["weight_gbps"] = row["routed_experts"] * expert_bytes / row["grouped_graph_us"] / 1e3
        bm = block_m_for(ids.numel(), E)
        for kernel in ("torch", "auto"):
            row[f"routing_{kernel}_graph_us"] = timed(
                lambda k=kernel: expert_blocks(ids, E, bm, kernel=k), True)
        blocks = expert_blocks(ids, E, bm)
        for c in dict.fromkeys([GroupedConfig(), *configs]):
            row[f"gemms_{c.name}_graph_us"] = timed(
                lambda c=c: nvfp4_grouped_experts(x, blocks, wts, *weights, config=c), True)
        return row

    for t in [int(v) for v in args.tokens.split(",")]:
        row = measure(t)
        rows.append(row)
        print(f"T={t}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()
                                     if k.endswith("_us")) + f" us, {row['ratio']:.2f}x, "
              f"{row['weight_gbps']:.0f} GB/s", flush=True)

    result = {
        "benchmark": "nvfp4 routed experts: grouped kernels vs bf16 experts",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": name, "torch": torch.__version__, "triton": triton.__version__,
        "experts": E, "top_k": K, "hidden": H, "inter": inter, "settle_s": args.settle_s,
        "rows": rows, "failures": failures, "notes": sorted(notes),
    }
    return write_results(args.out, result, markdown(result), failures)


def markdown(result: dict[str, Any]) -> str:
    """The results tables (x > 1: NVFP4 faster)."""
    dense = any("bf16_grouped_graph_us" in r for r in result["rows"])
    lines = [f"# NVFP4 routed experts: grouped kernels vs bf16 experts ({result['device']})",
             "",
             f"{result['date']}, torch {result['torch']}, triton {result['triton']}; "
             f"{result['experts']} experts, top-{result['top_k']}, hidden {result['hidden']}, "
             f"expert intermediate {result['inter']}, bf16 activations, uniform random "
             "routing, bf16 weights = the NVFP4 ones dequantized. Eager times by CUDA events "
             "(launches and host reads of the routing included); graph = replayed from a CUDA "
             "graph. GB/s = routed experts' NVFP4 bytes / nvfp4 graph time.", "",
             "| tokens | routed experts | bf16 per-expert us | nvfp4 grouped us | x |"
             + (" bf16 grouped graph us |" if dense else "") + " nvfp4 grouped graph us |"
             + (" x bf16 grouped |" if dense else "") + " GB/s |",
             "| ---: | ---: | ---: | ---: | ---: |" + (" ---: |" if dense else "") + " ---: |"
             + (" ---: |" if dense else "") + " ---: |"]
    for r in result["rows"]:
        g = r["grouped_graph_us"]
        d = r.get("bf16_grouped_graph_us", float("nan"))
        lines.append(f"| {r['tokens']} | {r['routed_experts']} | {r['bf16_us']:.1f} | "
                     f"{r['grouped_us']:.1f} | {r['ratio']:.2f} |"
                     + (f" {d:.1f} |" if dense else "") + f" {g:.1f} |"
                     + (f" {d / g:.2f} |" if dense else "") + f" {r['weight_gbps']:.0f} |")
    parts = [k for k in result["rows"][0] if k.startswith(("routing_", "gemms_"))] \
        if result["rows"] else []
    if parts:
        lines += ["", "Parts, each replayed from a CUDA graph (us): the routing grouped by "
                  "expert (`expert_blocks`: tensor operations, and `auto`: its Triton programs "
                  "on CUDA), and the two grouped GEMMs alone "
                  "with each launch shape (`n` the down GEMM's block_n, `w` warps, `s` "
                  "stages; the gate/up GEMM takes two turns of its paired weight).", "",
                  "| tokens | " + " | ".join(k.removesuffix("_graph_us") for k in parts) + " |",
                  "| ---: |" + " ---: |" * len(parts)]
        lines += [f"| {r['tokens']} | " + " | ".join(f"{r[k]:.1f}" for k in parts) + " |"
                  for r in result["rows"]]
    if result.get("notes"):
        lines += ["", *[f"Note: {n}" for n in result["notes"]]]
    if result["failures"]:
        lines += ["", "Wrong results:", *[f"- {f}" for f in result["failures"]]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
