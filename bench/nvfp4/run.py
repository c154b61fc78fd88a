"""Benchmark: weight-only NVFP4 linear (kernelbay-quant-nvfp4's ``nvfp4-triton``) against
torch bf16 ``F.linear`` on the same GPU, in the same run.

For each (N, K) in {(8192, 8192), (28672, 8192), (8192, 28672)} and M in {1, 4, 16, 64, 256}:

* ``bf16``: ``F.linear(x, W_bf16)`` (cuBLAS), the baseline of every ratio;
* ``nvfp4``: ``Nvfp4TritonLinear.apply`` with its default config table (what a model runs);
* with ``--configs all`` also every entry of ``triton_configs.CANDIDATES`` through
  ``linear_triton.run_config``, reporting the best (so one GPU run can retune the table).

Before timing, every kernel config is checked once per shape against the reference
(``kernelbay.formats.dequantize_nvfp4`` + a float32 matmul) with the bound of the tests
(``|y - y_ref| <= 4 u (|x| @ |W|^T)``, u = 2^-8 for bf16 output rounding + weight rounding);
a wrong result makes the script exit 1 (after writing what it measured).

Timing: ``triton.testing.do_bench_cudagraph`` (a CUDA graph of many calls, so Python launch
overhead is not measured) by default, or ``--timer events`` (``triton.testing.do_bench``).
Every timing starts after the GPU idled a quarter second (``bench/settle.py``: a kernel timed
right after cuBLAS ran up to 20% slower), and bf16 and the default method are timed
alternately ``--rounds`` times (default 2), each keeping its fastest.
Each method rotates over enough copies of its weight to exceed twice the L2 (50 MB on an
H200), so weights stream from HBM as in a real model. Bandwidth = (weight bytes + activation
bytes) / time; NVFP4 weight bytes are N*K/2 + N*K/16 (codes + E4M3 scales).

    python bench/nvfp4/run.py --out bench/results/nvfp4-h200          # about 1 minute
    python bench/nvfp4/run.py --configs all --out /tmp/nvfp4-tune      # about 2-3 minutes
"""

from __future__ import annotations

import argparse
import datetime
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from l2_rotation import copies_for, rotating  # from bench/, put on the path above
from report import write_results
from settle import add_timing_args, timed_us

HERE = Path(__file__).resolve().parent
SHAPES = ((8192, 8192), (28672, 8192), (8192, 28672))
MS = (1, 4, 16, 64, 256)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(HERE), help="folder for results.json / results.md")
    p.add_argument("--configs", default="default",
                   help="'all': also time every candidate kernel config per shape; or a "
                        "comma-separated list of candidate names (prefixes select several)")
    p.add_argument("--timer", choices=("graph", "events"), default="graph")
    p.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    p.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES),
                   help="N x K list, e.g. 8192x8192,28672x8192")
    p.add_argument("--ms", default=",".join(map(str, MS)), help="M list, e.g. 1,4,16")
    add_timing_args(p, rep_ms=40.0)
    p.add_argument("--rounds", type=int, default=2,
                   help="bf16 and the default method are timed alternately this many times, "
                        "each reporting its fastest")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        print("bench/nvfp4 needs a CUDA GPU (it times Triton kernels against cuBLAS); "
              "torch.cuda.is_available() is False here. The CPU tests cover correctness: "
              "python -m pytest plugins/quant_nvfp4/tests", file=sys.stderr)
        return 2
    import torch.nn.functional as F
    import triton
    from kernelbay.formats import dequantize_nvfp4, quantize_nvfp4
    from kernelbay.requests import LinearRequest
    from kernelbay_quant_nvfp4.linear_triton import Nvfp4TritonLinear, layout_tensors, run_config
    from kernelbay_quant_nvfp4.schemes import nvfp4_scheme
    from kernelbay_quant_nvfp4.triton_configs import (
        CANDIDATES,
        config_for,
        fit_block_m,
        layout_of,
        serving_name,
    )

    candidates = [] if args.configs == "default" else [
        c for c in CANDIDATES if args.configs == "all"
        or any(c.name.startswith(want) for want in args.configs.split(","))]
    if args.configs != "default" and not candidates:
        print(f"--configs {args.configs!r} names no candidate; valid: 'default', 'all' or "
              f"prefixes of {[c.name for c in CANDIDATES]}", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    unit = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ms = [int(v) for v in args.ms.split(",")]
    scheme = nvfp4_scheme("modelopt", w4a4=False)
    name, sms = ("cpu (Triton interpreter)", 0)
    if dev == "cuda":
        props = torch.cuda.get_device_properties(0)
        name, sms = props.name, props.multi_processor_count
    bulk_ok = dev == "cuda" and torch.cuda.get_device_capability(0)[0] >= 9

    def bench(fn: Callable[[], Any]) -> float:
        return timed_us(fn, dev, settle_s=args.settle_s, rep_ms=args.rep_ms,
                        graph=args.timer == "graph")

    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    gen = torch.Generator(device=dev).manual_seed(0)
    for n, k in shapes:
        w = torch.randn(n, k, generator=gen, device=dev, dtype=torch.float32) * 0.02
        packed, scales, g = quantize_nvfp4(w)
        w_ref = dequantize_nvfp4(packed, scales, g)  # fp32, the reference weight
        w_bf16 = w.to(dtype)
        del w
        nv_bytes = n * k // 2 + n * k // 16 + 4
        bf_bytes = n * k * 2
        nv_copies = [(packed.clone(), scales.clone(), g.clone())
                     for _ in range(copies_for(nv_bytes))]
        bf_copies = [w_bf16.clone() for _ in range(copies_for(bf_bytes))]
        layers = []
        method = Nvfp4TritonLinear(LinearRequest(k, n, scheme, args.dtype))
        for p, s, gg in nv_copies:
            layer = torch.nn.Module()
            method.create_weights(layer, device=dev)
            layer.weight.data.copy_(p)
            layer.weight_scale.data.copy_(s)
            layer.weight_scale_2.data.copy_(gg)
            method.process_weights_after_loading(layer)
            layers.append(layer)
        by_layout = {lay: [layout_tensors(p, s, lay) for p, s, _ in nv_copies]
                     for lay in {layout_of(c) for c in candidates}}
        for m in ms:
            x = torch.randn(m, k, generator=gen, device=dev).to(dtype)
            bound = 4 * unit * (x.float().abs() @ w_ref.abs().T) + 1e-5
            want = x.float() @ w_ref.T
            act_bytes = m * k * x.element_size()

            def verify(name: str, y: torch.Tensor, n: int = n, k: int = k, m: int = m,
                       want: torch.Tensor = want, bound: torch.Tensor = bound) -> bool:
                excess = float(((y.float() - want).abs() - bound).max())
                if y.shape != want.shape or excess > 0 or not bool(torch.isfinite(y).all()):
                    failures.append(f"{name} at N={n} K={k} M={m}: exceeds the bound by "
                                    f"{excess:.3g}")
                    return False
                return True

            def attempt(name: str, fn: Callable[[], torch.Tensor], n: int = n, k: int = k,
                        m: int = m) -> bool:
                # A config that fails to compile or run is reported, not fatal to the run.
                try:
                    y = fn()
                except Exception as exc:  # any failure is a result here
                    failures.append(f"{name} at N={n} K={k} M={m}: {type(exc).__name__}: "
                                    f"{str(exc)[:300]}")
                    return False
                return verify(name, y)

            default = config_for(m, method.table())
            ok = attempt(f"nvfp4-triton ({default.name})",
                         lambda md=method, ly=layers[0], x=x: md.apply(ly, x))
            bf_fn = rotating([lambda wb=wb, x=x: F.linear(x, wb) for wb in bf_copies])
            nv_fn = rotating([lambda ly=ly, x=x, md=method: md.apply(ly, x) for ly in layers])
            bf_t = nv_t = float("inf")
            for _ in range(max(1, args.rounds)):
                bf_t = min(bf_t, bench(bf_fn))
                nv_t = min(nv_t, bench(nv_fn)) if ok else float("nan")
            row: dict[str, Any] = {
                "n": n, "k": k, "m": m,
                "config": serving_name(fit_block_m(default, m), m, n, k, sms, bulk_ok)
                if default.path != "dequant" else default.name,
                "bf16_us": bf_t, "nvfp4_us": nv_t, "ratio": bf_t / nv_t,
                "bf16_gbps": (bf_bytes + act_bytes) / bf_t / 1e3,
                "nvfp4_gbps": (nv_bytes + act_bytes) / nv_t / 1e3, "correct": ok,
            }
            if candidates:
                tried: dict[str, float] = {}
                for config in candidates:
                    # each config reads its own layout of the copies' weights
                    weights = by_layout[layout_of(config)]
                    (p0, s0), g0 = weights[0], layers[0].weight_scale_2
                    if not attempt(config.name, lambda c=config, p0=p0, s0=s0, g0=g0, x=x:
                                   run_config(c, x, p0, s0, g0, None)):
                        continue
                    calls = [lambda ly=ly, wt=wt, c=config, x=x: run_config(
                        c, x, wt[0], wt[1], ly.weight_scale_2, None)
                        for ly, wt in zip(layers, weights, strict=True)]
                    tried[config.name] = bench(rotating(calls))
                best = min(tried, key=tried.__getitem__) if tried else ""
                row.update({"configs_us": tried, "best_config": best,
                            "best_us": tried.get(best, float("nan")),
                            "best_ratio": bf_t / tried[best] if best else float("nan")})
            rows.append(row)
            print(f"N={n} K={k} M={m}: bf16 {bf_t:.1f} us, nvfp4 {nv_t:.1f} us "
                  f"({bf_t / nv_t:.2f}x, {row['nvfp4_gbps']:.0f} GB/s)"
                  + (f", best {row['best_config']} {row['best_us']:.1f} us"
                     if candidates else ""), flush=True)
        layers, nv_copies, bf_copies, by_layout = [], [], [], {}  # free this shape's weights
        if dev == "cuda":
            torch.cuda.empty_cache()

    result = {
        "benchmark": "nvfp4 weight-only linear vs torch bf16 F.linear",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": name, "sms": sms,
        "torch": torch.__version__, "triton": triton.__version__, "dtype": args.dtype,
        "timer": args.timer, "settle_s": args.settle_s, "rounds": max(1, args.rounds),
        "configs": args.configs, "programmatic_launches": _programmatic(dev),
        "rows": rows, "failures": failures,
    }
    return write_results(args.out, result, markdown(result), failures)


def _programmatic(dev: str) -> bool:
    """Whether this run's kernels went out as programmatic dependents (KERNELBAY_PDL)."""
    import torch
    from kernelbay.cuda_jit import programmatic_launch

    return dev == "cuda" and programmatic_launch(torch.cuda.current_device())


def markdown(result: dict[str, Any]) -> str:
    """The results table (ratio > 1: NVFP4 faster than bf16)."""
    best = result["configs"] != "default"
    lines = [f"# NVFP4 weight-only linear vs bf16 ({result['device']})", "",
             f"{result['date']}, torch {result['torch']}, triton {result['triton']}, "
             f"{result['dtype']} activations, timer {result['timer']}, each timing after "
             f"{result.get('settle_s', 0)} s idle, bf16 and nvfp4 the fastest of {result.get('rounds', 1)} alternating "
             "rounds, programmatic launches "
             f"{'on' if result.get('programmatic_launches') else 'off'} (KERNELBAY_PDL). "
             "Bandwidth = (weight + activation bytes) / time.", "",
             "| N | K | M | bf16 us | nvfp4 us | ratio | bf16 GB/s | nvfp4 GB/s | config |"
             + (" best config | best us | best ratio |" if best else ""),
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"
             + (" --- | ---: | ---: |" if best else "")]
    for r in result["rows"]:
        line = (f"| {r['n']} | {r['k']} | {r['m']} | {r['bf16_us']:.1f} | {r['nvfp4_us']:.1f} "
                f"| {r['ratio']:.2f} | {r['bf16_gbps']:.0f} | {r['nvfp4_gbps']:.0f} "
                f"| {r['config']} |")
        if best:
            line += f" {r['best_config']} | {r['best_us']:.1f} | {r['best_ratio']:.2f} |"
        lines.append(line)
    if result["failures"]:
        lines += ["", "Wrong results:", *[f"- {f}" for f in result["failures"]]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
