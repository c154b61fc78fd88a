"""Benchmark: programmatic launches (``KERNELBAY_PDL``) in a decode step, not just back to back.

``run.py`` times one linear called over and over, the case where a kernel's prologue overlaps
the previous call of the same kernel. In a model the kernel before each NVFP4 linear is a norm,
an activation or a copy that does not release its dependents early. This script times two
Llama-70B-shaped decoder layers (hidden 8192, intermediate 28672, 64 query / 8 KV heads of
128) as one CUDA graph:

    rmsnorm -> qkv (10240 x 8192) -> attention stand-in (a copy of the query part)
    -> o_proj (8192 x 8192) -> residual add -> rmsnorm -> gate_up (57344 x 8192)
    -> silu(gate) * up -> down (8192 x 28672) -> residual add

with the linears in NVFP4 (``Nvfp4TritonLinear``, the serving path) with programmatic launches
on and off, and in bf16 (``F.linear``, cuBLAS) as the baseline, in the same run. The three are
timed alternately ``--rounds`` times after 0.25 s idle each, keeping each one's fastest. The
two layers' weights (about 0.96 GB in NVFP4, 3.4 GB in bf16) are far beyond the L2, so every
weight streams from HBM as in a model. Before timing, the NVFP4 step with launches on and off
are compared with each other (same weights, same input; the GEMV's build may differ with the
launch mode, so the bound is bf16 round-off, not bitwise).

    python bench/nvfp4/decode_step.py --ms 1,4,16 --out DIR      # H200, about 1 minute
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from report import write_results  # from bench/, put on the path above
from settle import settle

HERE = Path(__file__).resolve().parent
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 8192, 28672, 64, 8, 128
QKV = (HEADS + 2 * KV_HEADS) * HEAD_DIM


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(HERE / "decode_step_results"))
    p.add_argument("--ms", default="1,4,16", help="tokens per step (batch), e.g. 1,4,16")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rep-ms", type=float, default=40.0, help="timing budget per measurement")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench/nvfp4/decode_step.py needs a CUDA GPU; torch.cuda.is_available() is "
              "False here", file=sys.stderr)
        return 2
    import torch.nn.functional as F
    import triton
    import triton.testing
    from kernelbay.formats import quantize_nvfp4
    from kernelbay.requests import LinearRequest
    from kernelbay_quant_nvfp4.linear_triton import Nvfp4TritonLinear
    from kernelbay_quant_nvfp4.schemes import nvfp4_scheme

    dev, dtype = "cuda", torch.bfloat16
    scheme = nvfp4_scheme("modelopt", w4a4=False)
    gen = torch.Generator(device=dev).manual_seed(0)
    shapes = {"qkv": (QKV, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTER, HIDDEN),
              "down": (HIDDEN, INTER)}

    def nvfp4_layer(n: int, k: int, w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        method = Nvfp4TritonLinear(LinearRequest(k, n, scheme, "bfloat16"))
        layer = torch.nn.Module()
        method.create_weights(layer, device=dev)
        packed, scales, g = quantize_nvfp4(w)
        layer.weight.data.copy_(packed)
        layer.weight_scale.data.copy_(scales)
        layer.weight_scale_2.data.copy_(g)
        method.process_weights_after_loading(layer)
        return lambda x: method.apply(layer, x)

    def bf16_layer(w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        wb = w.to(dtype)
        return lambda x: F.linear(x, wb)

    nv_layers: list[dict[str, Callable[[torch.Tensor], torch.Tensor]]] = []
    bf_layers: list[dict[str, Callable[[torch.Tensor], torch.Tensor]]] = []
    norms = [torch.rand(HIDDEN, generator=gen, device=dev).to(dtype) + 0.5
             for _ in range(2 * args.layers)]
    for _ in range(args.layers):
        nv: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
        bf: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
        for name, (n, k) in shapes.items():
            w = torch.randn(n, k, generator=gen, device=dev) * k**-0.5
            nv[name], bf[name] = nvfp4_layer(n, k, w), bf16_layer(w)
            del w
        nv_layers.append(nv)
        bf_layers.append(bf)
    torch.cuda.empty_cache()

    def rmsnorm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype) * w

    def step(layers: list[dict[str, Callable[[torch.Tensor], torch.Tensor]]],
             h: torch.Tensor) -> torch.Tensor:
        for i, lin in enumerate(layers):
            qkv = lin["qkv"](rmsnorm(h, norms[2 * i]))
            attn = qkv[:, :HIDDEN].contiguous()  # stand-in for attention: one kernel between
            h = h + lin["o"](attn)
            gate, up = lin["gate_up"](rmsnorm(h, norms[2 * i + 1])).chunk(2, dim=-1)
            h = h + lin["down"](F.silu(gate) * up)
        return h

    def set_pdl(on: bool) -> None:
        os.environ["KERNELBAY_PDL"] = "1" if on else "0"

    def bench(fn: Callable[[], Any]) -> float:
        settle()
        with torch.cuda.stream(torch.cuda.Stream()):
            return float(triton.testing.do_bench_cudagraph(fn, rep=args.rep_ms)) * 1e3

    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    for m in (int(v) for v in args.ms.split(",")):
        h0 = torch.randn(m, HIDDEN, generator=gen, device=dev).to(dtype)
        outs = {}
        for on in (True, False):
            set_pdl(on)
            outs[on] = step(nv_layers, h0).float()
        scale = outs[False].abs().max().item() + 1.0
        diff = (outs[True] - outs[False]).abs().max().item()
        if not diff <= 2.0**-6 * scale or not bool(torch.isfinite(outs[True]).all()):
            failures.append(f"M={m}: launches on and off differ by {diff:.3g} "
                            f"(bound {2.0**-6 * scale:.3g})")
        set_pdl(True)
        edges = _edges_per_step(lambda h0=h0: step(nv_layers, h0))
        times = {"bf16": float("inf"), "pdl_off": float("inf"), "pdl_on": float("inf")}
        for _ in range(max(1, args.rounds)):
            times["bf16"] = min(times["bf16"], bench(lambda h0=h0: step(bf_layers, h0)))
            for on in (False, True):
                set_pdl(on)
                key = "pdl_on" if on else "pdl_off"
                times[key] = min(times[key], bench(lambda h0=h0: step(nv_layers, h0)))
        set_pdl(True)
        row = {"m": m, **{f"{k}_us": v for k, v in times.items()},
               "on_vs_off": times["pdl_off"] / times["pdl_on"],
               "ratio_on": times["bf16"] / times["pdl_on"],
               "ratio_off": times["bf16"] / times["pdl_off"], "max_diff_on_off": diff,
               "programmatic_edges": edges}
        rows.append(row)
        print(f"M={m}: bf16 {times['bf16']:.1f} us, nvfp4 off {times['pdl_off']:.1f} us, "
              f"on {times['pdl_on']:.1f} us (speed-up on/off {row['on_vs_off']:.3f})",
              flush=True)

    props = torch.cuda.get_device_properties(0)
    result = {
        "benchmark": "two NVFP4 decoder layers (Llama-70B shapes) as one CUDA graph, "
                     "programmatic launches on vs off, vs bf16",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": props.name, "torch": torch.__version__, "triton": triton.__version__,
        "layers": args.layers, "rounds": max(1, args.rounds), "rows": rows,
        "failures": failures,
    }
    return write_results(args.out, result, markdown(result), failures)


def _edges_per_step(fn: Callable[[], Any]) -> int:
    """Programmatic edges in a CUDA graph of one step (``cuda_jit.programmatic_edges``)."""
    import torch
    from kernelbay.cuda_jit import programmatic_edges

    before = programmatic_edges()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        fn()
    torch.cuda.synchronize()
    return programmatic_edges() - before


def markdown(result: dict[str, Any]) -> str:
    """The results table (speed-up on / off = off time / on time; > 1: programmatic launches
    faster)."""
    lines = [f"# NVFP4 decode step, programmatic launches on vs off ({result['device']})", "",
             f"{result['date']}, torch {result['torch']}, triton {result['triton']}; "
             f"{result['layers']} Llama-70B-shaped decoder layers as one CUDA graph (norms, "
             "a copy standing in for attention, SiLU-gate and residual adds in torch between "
             "the linears); each time the fastest of "
             f"{result['rounds']} alternating rounds after 0.25 s idle.", "",
             "| M | bf16 us | NVFP4 off us | NVFP4 on us | speed-up on / off | bf16 / on | bf16 / off "
             "| programmatic edges |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in result["rows"]:
        lines.append(f"| {r['m']} | {r['bf16_us']:.1f} | {r['pdl_off_us']:.1f} "
                     f"| {r['pdl_on_us']:.1f} | {r['on_vs_off']:.3f} | {r['ratio_on']:.2f} "
                     f"| {r['ratio_off']:.2f} | {r.get('programmatic_edges')} |")
    if result["failures"]:
        lines += ["", "Wrong results:", *[f"- {f}" for f in result["failures"]]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
