"""Benchmark: OCP MXFP4 routed experts (kernelbay-quant-mxfp4-rocm's ``mxfp4-moe-triton``: the
routing grouped by expert on the device, then two grouped GEMMs) against bf16 experts and
against the same GEMMs run expert by expert, in the same run.

One MoE layer of the DeepSeek-V3 family by default (256 experts, top-8, hidden 7168, expert
intermediate 2048), T tokens routed uniformly at random (distinct experts per token, fixed
seed), W4A16 (``--activation mxfp4-dynamic`` / ``mxfp8-dynamic`` for W4A4 / W4A8). The bf16
weights are the MXFP4 ones dequantized, so every path computes the same function:

* ``bf16 per-expert``: one ``F.linear`` per projection and routed expert, the routing read on
  the host (``kernelbay.layers.moe.swiglu_experts``, the core's ``torch-moe``), eager (CUDA
  events, launches included): it cannot be captured;
* ``bf16 grouped``: torch's grouped GEMM over the slots sorted by expert
  (``bench/moe_common.py``), replayed from a CUDA graph (skipped with a note where torch
  lacks it);
* ``mxfp4 per-expert``: the dense ``mxfp4_gemm`` once per projection and routed expert, the
  routing read on the host (what ``mxfp4-moe-triton`` ran before its grouped GEMMs), eager;
* ``mxfp4 grouped``: ``Mxfp4MoETriton.apply_moe``, eager and replayed from a CUDA graph.

``x bf16 grouped`` = bf16 grouped graph time / mxfp4 grouped graph time; ``x per-expert`` =
mxfp4 per-expert eager time / mxfp4 grouped eager time. GB/s counts the MXFP4 bytes (codes +
E8M0 scales) of the distinct experts the routing selects over the mxfp4 graph time.

Correctness: every result is checked against ``bf16 per-expert`` (with MX activations: the
same experts on fake-quantized activations, ``mxfp4-moe-emulation``'s math) to 2^-5 of the
output's largest magnitude (far below what a wrong expert, scale or routing weight gives); a
mismatch makes the script exit 1 after writing what it measured.

    python bench/mxfp4/moe.py --out bench/results/mxfp4-moe-h200       # about 2 minutes
    TRITON_INTERPRET=1 python bench/mxfp4/moe.py --device cpu --experts 4 --top-k 2 --hidden 256 \\
        --inter 128 --tokens 1,5 --out DIR                               # no GPU
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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for results.json / results.md")
    add_layer_args(p)
    p.add_argument("--activation", default=None,
                   choices=["mxfp4-dynamic", "mxfp8-dynamic"],
                   help="dynamic MX activations (default: bf16, W4A16)")
    p.add_argument("--configs", default="",
                   help="also time each grouped GEMM alone (W4A16: SwiGLU in the gate/up one, "
                        "routing weights in the down one; routing made "
                        "beforehand) with each of these launch shapes, e.g. n64k128w4s3,"
                        "n128k256w8s3 (triton_grouped.GroupedConfig.parse)")
    p.add_argument("--layout", default="auto", choices=["auto", "checkpoint", "fragment"],
                   help="stacked expert weight layout (triton_grouped.EXPERT_LAYOUTS; auto: what "
                        "the method stores on this machine), to compare them")
    add_timing_args(p, rep_ms=60.0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import os

    import torch

    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        print("bench/mxfp4/moe.py needs a CUDA GPU; torch.cuda.is_available() is False here. "
              "The CPU tests cover correctness: python -m pytest plugins/quant_mxfp4_rocm/tests",
              file=sys.stderr)
        return 2
    # the Triton methods run on CUDA when forced: this variable is how
    os.environ["KERNELBAY_MXFP4_MOE_BACKEND"] = "triton"
    import torch.nn.functional as F
    import triton
    from kernelbay.formats import dequantize_mx, quantize_mx, unpack_e2m1_words
    from kernelbay.layers.expert_blocks import expert_blocks
    from kernelbay.layers.moe import MOE_EXPERTS_ROLE, combine_experts, expert_tensor, swiglu
    from kernelbay.layers.slot_sum import sum_slots
    from kernelbay.requests import LinearRequest, QuantScheme
    from kernelbay_quant_mxfp4_rocm.emulation import MX_ACTIVATIONS, fake_quantize_mx
    from kernelbay_quant_mxfp4_rocm.triton_gemm import mxfp4_gemm
    from kernelbay_quant_mxfp4_rocm.triton_grouped import (
        GroupedConfig,
        block_rows,
        expert_layout,
        grouped_mxfp4_gemm,
        layout_experts,
    )
    from kernelbay_quant_mxfp4_rocm.triton_moe import Mxfp4MoETriton

    E, K, H, inter = args.experts, args.top_k, args.hidden, args.inter
    scheme = QuantScheme("mxfp4", "e2m1", (1, 32), "e8m0", False, args.activation, "quark",
                         (("scale_mode", "even"),))
    method = Mxfp4MoETriton(LinearRequest(H, inter, scheme, "bfloat16", False,
                                          MOE_EXPERTS_ROLE, num_experts=E))
    name = torch.cuda.get_device_name(0) if dev == "cuda" else "cpu (Triton interpreter)"
    gen = torch.Generator(device=dev).manual_seed(0)
    shapes = {"gate_proj": (inter, H), "up_proj": (inter, H), "down_proj": (H, inter)}
    distinct = min(args.distinct, E)
    base = {p: [quantize_mx(torch.randn(*s, generator=gen, device=dev) * 0.02, "e2m1", "even")
                for _ in range(distinct)] for p, s in shapes.items()}
    layer = torch.nn.Module()
    method.create_weights(layer, device=dev)
    for e in range(E):
        for p in shapes:
            packed, scales = base[p][e % distinct]
            getattr(layer, expert_tensor(e, p)).data.copy_(packed)
            getattr(layer, expert_tensor(e, p, "weight_scale")).data.copy_(scales)
    method.process_weights_after_loading(layer)
    if args.layout != "auto":
        for name in ("w13", "w2"):
            held = getattr(layer, name)
            if expert_layout(held.data) != "checkpoint":  # back to the bytes first
                e, n = held.shape[:2]
                held.data = unpack_e2m1_words(held.data.reshape(e * n, -1, 4)).view(e, n, -1)
            held.data = layout_experts(held.data, args.layout)
    dense = {p: [dequantize_mx(*q, "e2m1").bfloat16() for q in qs] for p, qs in base.items()}
    w13 = torch.stack([torch.cat([dense["gate_proj"][e % distinct],
                                  dense["up_proj"][e % distinct]]) for e in range(E)])
    w2 = torch.stack([dense["down_proj"][e % distinct] for e in range(E)])
    del dense, base
    expert_bytes = 3 * (H * inter // 2 + H * inter // 32)
    configs = [GroupedConfig.parse(c) for c in args.configs.split(",") if c]
    q13, s13, q2, s2 = (layer.w13.data, layer.w13_scale.data, layer.w2.data,
                        layer.w2_scale.data)
    top13, top2 = layer.mxfp4_scale_max13, layer.mxfp4_scale_max2  # what apply_moe passes

    def mxfp4_per_expert(x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor
                         ) -> torch.Tensor:
        # the dense GEMM once per projection and routed expert (W4A16)
        def expert_mlp(e: int, tokens: torch.Tensor) -> torch.Tensor:
            gu = mxfp4_gemm(x[tokens], q13[e], s13[e])
            return mxfp4_gemm(F.silu(gu[:, :inter]) * gu[:, inter:], q2[e], s2[e])
        return combine_experts(x, ids, wts, H, expert_mlp, num_experts=E)

    def mx_reference(x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor) -> torch.Tensor:
        # the emulation's math (mxfp4-moe-emulation): activations and SwiGLU output
        # fake-quantized, float32 matmuls on the dequantized weights (exact in bf16)
        elem = MX_ACTIVATIONS[args.activation]
        xq = fake_quantize_mx(x, elem, "even")

        def expert_mlp(e: int, tokens: torch.Tensor) -> torch.Tensor:
            h = fake_quantize_mx(swiglu(F.linear(xq[tokens], w13[e].float())), elem, "even")
            return F.linear(h, w2[e].float())
        return combine_experts(x, ids, wts, H, expert_mlp, num_experts=E)

    def timed(fn: Callable[[], Any], graph: bool = False) -> float:
        return timed_us(fn, dev, settle_s=args.settle_s, rep_ms=args.rep_ms, graph=graph)

    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    notes: set[str] = set()
    cpu_gen = torch.Generator().manual_seed(1)

    def measure(t: int) -> dict[str, Any]:
        ids, wts = uniform_routing(t, E, K, cpu_gen, dev)
        x = torch.randn(t, H, generator=gen, device=dev).bfloat16()
        reference = None
        if args.activation is not None:
            reference = (f"the experts on {args.activation} activations",
                         mx_reference(x, ids, wts))
        check, row = bf16_baselines(x, ids, wts, w13, w2, timed, failures, notes, reference)
        row = {"tokens": t, **row}
        check("mxfp4 grouped", method.apply_moe(layer, x, ids, wts))
        if args.activation is None:
            check("mxfp4 per-expert", mxfp4_per_expert(x, ids, wts))
            row["per_expert_us"] = timed(lambda: mxfp4_per_expert(x, ids, wts))
        row["grouped_us"] = timed(lambda: method.apply_moe(layer, x, ids, wts))
        row["grouped_graph_us"] = timed(lambda: method.apply_moe(layer, x, ids, wts), True)
        row["weight_gbps"] = row["routed_experts"] * expert_bytes / row["grouped_graph_us"] / 1e3
        blocks = expert_blocks(ids, E, block_rows(ids.numel(), E))
        h = torch.randn(ids.numel(), inter, generator=gen, device=dev).bfloat16()
        # the layer's steps besides the GEMMs, each alone: the routing, the slot sum with its
        # rounding (one launch), and the tensor sum + cast it replaced (two)
        y = torch.randn(ids.numel(), H, generator=gen, device=dev)
        row["routing_graph_us"] = timed(
            lambda: expert_blocks(ids, E, block_rows(ids.numel(), E)), True)
        row["slot_sum_graph_us"] = timed(lambda: sum_slots(y, K, torch.bfloat16), True)
        row["sum_cast_graph_us"] = timed(
            lambda: y.view(t, K, H).sum(1).to(torch.bfloat16), True)
        for c in dict.fromkeys([GroupedConfig(), *configs]):
            # each GEMM timed alone: the two projections may prefer different launch shapes
            row[f"gateup_{c.name}_graph_us"] = timed(lambda c=c: grouped_mxfp4_gemm(
                x, q13, s13, blocks, gather=True, gated=True, out_dtype=torch.bfloat16,
                scale_max=top13, config=c), True)
            row[f"down_{c.name}_graph_us"] = timed(lambda c=c: grouped_mxfp4_gemm(
                h, q2, s2, blocks, gather=False, routing_weights=wts, out_dtype=torch.float32,
                scale_max=top2, config=c), True)
        return row

    for t in [int(v) for v in args.tokens.split(",")]:
        row = measure(t)
        rows.append(row)
        print(f"T={t}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()
                                     if k.endswith("_us")) + f" us, "
              f"{row['weight_gbps']:.0f} GB/s", flush=True)

    result = {
        "benchmark": "mxfp4 routed experts: grouped kernels vs bf16 and per-expert experts",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": name, "torch": torch.__version__, "triton": triton.__version__,
        "experts": E, "top_k": K, "hidden": H, "inter": inter,
        "activation": args.activation or "bf16", "settle_s": args.settle_s,
        "layout": expert_layout(q13), "default_config": GroupedConfig().name,
        "rows": rows, "failures": failures, "notes": sorted(notes),
    }
    return write_results(args.out, result, markdown(result), failures)


def _cell(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(result: dict[str, Any]) -> str:
    """The results table (x > 1: the grouped MXFP4 experts faster)."""
    lines = [f"# MXFP4 routed experts: grouped kernels vs bf16 and per-expert "
             f"({result['device']})", "",
             f"{result['date']}, torch {result['torch']}, triton {result['triton']}; "
             f"{result['experts']} experts, top-{result['top_k']}, hidden {result['hidden']}, "
             f"expert intermediate {result['inter']}, activations {result['activation']}, "
             f"expert weights stored as {result.get('layout', 'checkpoint')} words, "
             "uniform random routing, bf16 weights = the MXFP4 ones dequantized. Eager times "
             "by CUDA events (launches and host reads of the routing included); graph = "
             "replayed from a CUDA graph. GB/s = routed experts' MXFP4 bytes / mxfp4 graph "
             "time. `python bench/mxfp4/moe.py`.", "",
             "| tokens | routed experts | bf16 per-expert us | mxfp4 per-expert us | mxfp4 "
             "grouped us | x per-expert | bf16 grouped graph us | mxfp4 grouped graph us | "
             "x bf16 grouped | GB/s |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in result["rows"]:
        per, dense = r.get("per_expert_us"), r.get("bf16_grouped_graph_us")
        g = r["grouped_graph_us"]
        lines.append(f"| {r['tokens']} | {r['routed_experts']} | {r['bf16_us']:.1f} | "
                     f"{_cell(per)} | {r['grouped_us']:.1f} | "
                     f"{_cell(per and per / r['grouped_us'], 2)} | {_cell(dense)} | {g:.1f} | "
                     f"{_cell(dense and dense / g, 2)} | {r['weight_gbps']:.0f} |")
    for gemm, what in (("gateup", "gate/up GEMM (gated: SiLU(gate) * up stored, bf16)"),
                       ("down", "down GEMM (routing weights applied, float32 out)")):
        parts = ([k for k in result["rows"][0] if k.startswith(gemm + "_")]
                 if result["rows"] else [])
        if not parts:
            continue
        lines += ["", f"The grouped {what} alone (W4A16, routing made beforehand), replayed "
                  "from a CUDA graph (us), per launch shape (`n` weight rows and `k` K elements "
                  "per program, `w` warps, `s` stages):", "",
                  "| tokens | " + " | ".join(k[len(gemm) + 1:].removesuffix("_graph_us")
                                           for k in parts) + " |",
                  "| ---: |" + " ---: |" * len(parts)]
        lines += [f"| {r['tokens']} | " + " | ".join(f"{r[k]:.1f}" for k in parts) + " |"
                  for r in result["rows"]]
    # W4A16 only: the GEMMs timed alone are the weight-only ones
    if result["rows"] and "routing_graph_us" in result["rows"][0] \
            and result["activation"] == "bf16":
        lines += ["", "Where the layer's time goes (W4A16, each step alone from a CUDA graph, "
                  "us; rest = the layer minus its steps: launch gaps and allocations). "
                  "Slot sum = `kernelbay.layers.slot_sum` (sum and rounding in one launch); "
                  "sum + cast = the two tensor kernels it replaced:", "",
                  "| tokens | layer | gate/up | down | routing | slot sum | rest | "
                  "sum + cast |", "| ---: |" + " ---: |" * 7]
        for r in result["rows"]:
            tile = result["default_config"]
            gu, dn = r[f"gateup_{tile}_graph_us"], r[f"down_{tile}_graph_us"]
            rest = (r["grouped_graph_us"] - gu - dn - r["routing_graph_us"]
                    - r["slot_sum_graph_us"])
            lines.append(f"| {r['tokens']} | {r['grouped_graph_us']:.1f} | {gu:.1f} | "
                         f"{dn:.1f} | {r['routing_graph_us']:.1f} | "
                         f"{r['slot_sum_graph_us']:.1f} | {rest:.1f} | "
                         f"{r['sum_cast_graph_us']:.1f} |")
    lines += [f"Note: {n}" for n in result["notes"]]
    if result["failures"]:
        lines += ["", "Wrong results:", *[f"- {f}" for f in result["failures"]]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
