"""Benchmark: the Triton MXFP4-weight GEMM (kernelbay-quant-mxfp4-rocm) against torch bf16
matmul on this GPU, both in the same run.

For each (N, K) in {(8192, 8192), (28672, 8192), (8192, 28672)} (bench/nvfp4's shapes) and M
in {1, 4, 16, 64, 256} it times, with CUDA graphs (``triton.testing.do_bench_cudagraph``,
median), so that launch overhead is what a graph-captured decode step pays:

* ``bf16``: ``F.linear(x, W)`` with W the dequantized weight in bf16 (the baseline);
* ``mxfp4``: the ``mxfp4-triton`` linear method (on CUDA ``mxfp4-triton-cuda``, chosen by
  forcing it, ``KERNELBAY_FORCE_LINEAR``'s policy entry) with its default config, W4A16;
* ``w4a4``: the same GEMM fed by the dynamic MXFP4 activation quantizer (its kernels, then
  the GEMM's activation decode and the GEMM);
* with ``--configs all``: every ``candidate_configs`` entry of the GEMM (paths ``decode``,
  ``scaled`` = ``tl.dot_scaled``, ``dequant`` = bf16 weight + torch matmul) for the M of
  ``--sweep-ms`` (until ``--budget`` seconds), so one GPU run shows which config to make
  the default (the best is reported per shape).

Every timing starts after the GPU idled a quarter second (``bench/settle.py``: a kernel timed
right after a long cuBLAS GEMM ran up to 20% slower on the H200).

A measurement that raises (e.g. a host sync under CUDA-graph capture) is printed (FAILED),
recorded in its row as NaN with the error, and the script goes on; it exits with status 1
after writing the results.

Before timing, every kernel/config is checked once per shape against the reference
(``kernelbay.formats.dequantize_mx`` + a float64 matmul): |y - ref| <= one bf16 rounding +
K * 2^-22 * (|x| @ |W|^T). A mismatch is printed (WRONG RESULT), recorded in the row, and
makes the script exit with status 1 after writing the results.

Reported: time per call (us), ratio bf16 / mxfp4 (> 1: faster), and GB/s of bytes moved
(weights + scales + activations + output; bf16 weights are 2 bytes per element, MXFP4 0.53).

    python bench/mxfp4/run.py --out DIR                 # default configs, about 1 minute
    python bench/mxfp4/run.py --configs all --out DIR   # tuning sweep, under 2 minutes
    python bench/mxfp4/run.py --configs m16n64k256s4,m16n64k256s2 --ms 1,16 --sweep-ms 1,16
                                                    # only the candidates named so
    TRITON_INTERPRET=1 python bench/mxfp4/run.py --smoke --configs all --out DIR  # no GPU
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from l2_rotation import copies_for, rotating  # from bench/, put on the path above
from report import write_results
from settle import SETTLE_S, settle

SHAPES = ((8192, 8192), (28672, 8192), (8192, 28672))
MS = (1, 4, 16, 64, 256)
HERE = Path(__file__).resolve().parent


DEVICE = {"name": "cuda"}
#: Every wrong result seen (the script exits 1 after writing the results when not empty).
WRONG: list[str] = []
#: Every measurement that raised (recorded in its row; the script goes on, then exits 1).
FAILED: list[str] = []


def attempt(row: dict[str, Any], key: str, label: str, thunk: Any) -> Any:
    """``row[key] = thunk()``; an exception is printed, recorded in ``row[key + '_error']``
    and ``FAILED`` (the value becomes NaN) so that one broken measurement does not stop the
    others."""
    try:
        row[key] = thunk()
    except Exception as exc:  # recorded and reported; exit 1 at the end
        first = (str(exc).splitlines() or [""])[0][:200]
        msg = f"{label}: {type(exc).__name__}: {first}"
        print(f"FAILED: {msg}", file=sys.stderr, flush=True)
        FAILED.append(msg)
        row[key], row[key + "_error"] = float("nan"), msg
        if DEVICE["name"] == "cuda":
            try:  # surface (and clear) an asynchronous error before the next measurement
                torch.cuda.synchronize()
            except Exception as sync_exc:
                FAILED.append(f"{label}: after the failure: {sync_exc}"[:300])
    return row[key]


def bench(fn: Any, rep: int) -> float:
    """Median microseconds per call, CUDA-graph replayed (``--smoke``: one timed call)."""
    import triton.testing

    if DEVICE["name"] == "cpu":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    fn()
    settle()
    ms = triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")
    return float(ms) * 1000.0


def check(name: str, y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    """Compare with the reference; record a mismatch in ``WRONG`` (reported loudly, exit 1 at
    the end). Returns the max error / bound (inf when not finite)."""
    ref = x.double() @ w.double().T
    k = x.shape[-1]
    bound = k * 2.0**-22 * (x.abs().double() @ w.abs().double().T) + 2.0**-126 * k
    if y.dtype == torch.bfloat16:
        bound = bound + ref.abs() * 2.0**-8  # one rounding to bf16
    err = (y.double() - ref).abs()
    ratio = float((err / bound).max())
    if not torch.isfinite(y).all() or not ratio <= 1.0:
        print(f"WRONG RESULT: {name}: max |y - ref| / bound = {ratio:.3g}", file=sys.stderr,
              flush=True)
        WRONG.append(name)
        return float("inf")
    return ratio


def forced_method(n: int, k: int) -> Any:
    """The Triton linear method chosen by kernelbay's selection, forced on CUDA."""
    from kernelbay.device import parse_device, probe_device
    from kernelbay.kinds import BackendKind
    from kernelbay.plugins import get_registry
    from kernelbay.requests import LinearRequest, QuantScheme
    from kernelbay.select import select

    device = probe_device() if DEVICE["name"] == "cuda" else parse_device("sm_90")
    registry = get_registry()
    name = "mxfp4-triton" if device.platform == "rocm" else "mxfp4-triton-cuda"
    policy = registry.policy.with_force(BackendKind.LINEAR, name)
    scheme = QuantScheme("mxfp4", "e2m1", (1, 32), "e8m0", False, None, "quark",
                         (("scale_mode", "even"),))
    selection = select(BackendKind.LINEAR, LinearRequest(k, n, scheme, "bfloat16"), device,
                       policy, registry=registry)
    return selection.backend(selection.request), selection


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(HERE), help="folder for results.json/.md")
    parser.add_argument("--configs", default="default",
                        help="'default', 'all' (sweep every candidate) or comma-separated "
                             "name prefixes of the candidates to sweep (e.g. m16n64k256s4) "
                             "and whole config names, candidates or not (e.g. "
                             "m16n64k256s1w4p6-fragment, m16n64k256s4w4p3r96-fragment)")
    parser.add_argument("--ms", default=",".join(map(str, MS)), help="comma-separated M")
    parser.add_argument("--shapes", default="all", help="'all' or N1xK1,N2xK2")
    parser.add_argument("--sweep-ms", default="16,64,256",
                        help="comma-separated M whose configs --configs all times")
    parser.add_argument("--rep", type=int, default=40, help="ms of replays per timing")
    parser.add_argument("--sweep-rep", type=int, default=20,
                        help="ms of replays per config timing of the sweep")
    parser.add_argument("--budget", type=float, default=95.0,
                        help="seconds after which the config sweep stops (noted in results)")
    parser.add_argument("--smoke", action="store_true",
                        help="check the script without a GPU: TRITON_INTERPRET=1, tiny shape")
    args = parser.parse_args()
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("--smoke needs TRITON_INTERPRET=1 in the environment", file=sys.stderr)
            return 2
        DEVICE["name"] = "cpu"
        args.shapes, args.ms, args.sweep_ms = "96x128", "1,17", "1,17"
    elif not torch.cuda.is_available():
        print("bench/mxfp4 needs a GPU (CUDA or ROCm)", file=sys.stderr)
        return 2
    shapes = SHAPES if args.shapes == "all" else tuple(
        tuple(int(v) for v in s.split("x")) for s in args.shapes.split(","))
    ms = tuple(int(m) for m in args.ms.split(","))
    start = time.time()
    rows: list[dict[str, Any]] = []
    state = {"sweep_cut": False, "method": ""}
    for n, k in shapes:
        rows.extend(run_shape(n, k, ms, args, start, state))
        if DEVICE["name"] == "cuda":
            torch.cuda.empty_cache()
    sweep_cut, chosen_name = state["sweep_cut"], state["method"]
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name() if DEVICE["name"] == "cuda" else "cpu (smoke)",
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "method": chosen_name,
        "timing": f"triton.testing.do_bench_cudagraph, median, each after {SETTLE_S} s idle",
        "configs": args.configs,
        "programmatic_launches": _programmatic(),
        "sweep_cut_by_budget": sweep_cut,
        "wrong": list(WRONG),
        "failed": list(FAILED),
        "seconds": round(time.time() - start, 1),
        "rows": rows,
    }
    status = write_results(args.out, result, markdown(result),
                           [f"wrong: {w}" for w in WRONG] + [f"failed: {f}" for f in FAILED])
    print(f"wrote results.json and results.md under {args.out}")
    return status


def run_shape(n: int, k: int, ms: tuple[int, ...], args: argparse.Namespace, start: float,
              state: dict[str, Any]) -> list[dict[str, Any]]:
    """Check and time every M of one (N, K)."""
    from kernelbay.formats import dequantize_mx, quantize_mx
    from kernelbay_quant_mxfp4_rocm import triton_mx
    from kernelbay_quant_mxfp4_rocm.triton_gemm import (
        default_config,
        mxfp4_gemm,
        prepare_weight_scales,
        weight_layout,
    )

    torch.manual_seed(n + k)
    dev = DEVICE["name"]
    packed, scales = quantize_mx(torch.randn(n, k, device=dev) * 0.02, "e2m1", "even")
    w_deq = dequantize_mx(packed, scales, "e2m1")  # float32, exact
    w_bf16 = w_deq.bfloat16()  # exact too (two significant bits)
    state["scale_max"] = prepare_weight_scales(scales)
    method, selection = forced_method(n, k)
    state["method"] = selection.backend.name
    def copies(nbytes: int) -> int:
        """Weight copies a timing rotates over (past twice the L2, so weights come from HBM;
        one on the CPU smoke run)."""
        return copies_for(nbytes) if dev == "cuda" else 1

    layers = []
    for _ in range(copies(n * k // 2 + n * k // 32)):
        ly = torch.nn.Module()
        ly.weight = torch.nn.Parameter(packed.clone(), requires_grad=False)
        ly.weight_scale = torch.nn.Parameter(scales.clone(), requires_grad=False)
        method.process_weights_after_loading(ly)
        layers.append(ly)
    layer = layers[0]
    state["packed_copies"] = [(ly.weight_scale, packed if ly is layer else packed.clone())
                              for ly in layers]
    bf_copies = [w_bf16] + [w_bf16.clone() for _ in range(copies(2 * n * k) - 1)]
    rows = []
    for m in ms:
        x = torch.randn(m, k, device=dev).bfloat16()
        row: dict[str, Any] = {"N": n, "K": k, "M": m}
        tag = f"N={n} K={k} M={m}"
        attempt(row, "check_mxfp4", f"check {state['method']} {tag}",
                lambda x=x, tag=tag: check(f"{state['method']} {tag}", method.apply(layer, x),
                                           x, w_deq))

        def check_w4a4(x: torch.Tensor = x, tag: str = tag) -> float:
            xq, xs = triton_mx.quantize_mx(x, "e2m1", "even")
            y4 = mxfp4_gemm(xq, packed, scales, x_scale=xs, out_dtype=torch.float32,
                            scale_max=state["scale_max"])
            return check(f"w4a4 {tag}", y4, dequantize_mx(xq, xs, "e2m1"), w_deq)

        attempt(row, "check_w4a4", f"check w4a4 {tag}", check_w4a4)
        attempt(row, "bf16_us", f"time bf16 {tag}", lambda x=x: bench(
            rotating([lambda wb=wb: F.linear(x, wb) for wb in bf_copies]), args.rep))
        attempt(row, "mxfp4_us", f"time mxfp4 {tag}", lambda x=x: bench(
            rotating([lambda ly=ly: method.apply(ly, x) for ly in layers]), args.rep))
        attempt(row, "w4a4_us", f"time w4a4 {tag}", lambda x=x: bench(
            rotating([_w4a4(x, p, s, state["scale_max"]) for s, p in state["packed_copies"]]),
            args.rep))
        row["default_config"] = default_config(
            m, n, k, layout=weight_layout(layer.weight)).describe()
        if args.configs != "default" and m in {int(v) for v in args.sweep_ms.split(",")}:
            sweep(row, x, packed, scales, w_deq, args, start, state)
        weight_bytes = n * k // 2 + n * k // 32
        io_bytes = 2 * m * k + 2 * m * n
        row["ratio"] = row["bf16_us"] / row["mxfp4_us"]
        row["mxfp4_GBps"] = (weight_bytes + io_bytes) / row["mxfp4_us"] / 1e3
        row["bf16_GBps"] = (2 * n * k + io_bytes) / row["bf16_us"] / 1e3
        rows.append(row)
        best = (f", best {row['best_config']} {row['best_us']:.1f} us"
                if "best_us" in row else "")
        print(f"{tag}: bf16 {row['bf16_us']:.1f} us, mxfp4 {row['mxfp4_us']:.1f} "
              f"us ({row['ratio']:.2f}x), w4a4 {row['w4a4_us']:.1f} us{best}", flush=True)
    return rows


def sweep(row: dict[str, Any], x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
          w_deq: torch.Tensor, args: argparse.Namespace, start: float,
          state: dict[str, Any]) -> None:
    """Check and time every candidate config of the GEMM for this shape (until --budget)."""
    from kernelbay_quant_mxfp4_rocm.triton_gemm import (
        READABLE,
        candidate_configs,
        config_dict,
        layout_weight,
        mxfp4_gemm,
    )

    m, k = x.shape
    n = packed.shape[0]
    top = state["scale_max"]
    tried: list[dict[str, Any]] = []
    copies = state["packed_copies"]
    # each config reads the copies in its own layout
    by_layout = {lay: [layout_weight(p, lay) for _, p in copies]
                 for lay in ("checkpoint", "repacked", "fragment")}
    prefixes = None if args.configs == "all" else tuple(args.configs.split(","))
    configs = candidate_configs(m, n, k)
    if prefixes:
        named = named_configs(prefixes)
        for entry in prefixes:  # a typo would time nothing, silently
            if not any(c.describe().startswith(entry) for c in [*configs, *named]):
                print(f"--configs {entry!r}: no candidate starts with it and it is no whole "
                      "config name (GemmConfig.parse); skipped", file=sys.stderr, flush=True)
        configs = [c for c in configs if c.describe().startswith(prefixes)]
        configs += [c for c in named if c not in configs]
    for cfg in configs:
        weights = next(by_layout[lay] for lay, paths in READABLE.items() if cfg.path in paths)
        weight = weights[0]
        if time.time() - start > args.budget:
            state["sweep_cut"] = True
            break
        try:
            y = mxfp4_gemm(x, weight, scales, config=cfg, scale_max=top)
        except Exception as exc:  # a config the compiler refuses (resources): record it
            tried.append({**config_dict(cfg), "name": cfg.describe(), "error": str(exc)[:200]})
            continue
        if check(f"config {cfg.describe()} N={n} K={k} M={m}", y, x, w_deq) > 1.0:
            tried.append({**config_dict(cfg), "name": cfg.describe(), "error": "wrong result"})
            continue
        entry: dict[str, Any] = {**config_dict(cfg), "name": cfg.describe()}
        attempt(entry, "us", f"time config {cfg.describe()} N={n} K={k} M={m}",
                lambda cfg=cfg, weights=weights: bench(rotating(
                    [lambda w=w, s=s: mxfp4_gemm(x, w, s, config=cfg, scale_max=top)
                     for w, (s, _) in zip(weights, copies, strict=True)]), args.sweep_rep))
        tried.append(entry)
    row["configs"] = tried
    timed = [t for t in tried if t.get("us", float("nan")) == t.get("us", float("nan"))]
    if timed:
        best = min(timed, key=lambda t: t["us"])
        row["best_config"], row["best_us"] = best["name"], best["us"]


def named_configs(names: tuple[str, ...]) -> list[Any]:
    """The entries of ``--configs`` that are whole config names (``GemmConfig.parse``), so
    that a sweep can time configs outside ``candidate_configs`` (other splits, stages, a
    register cap); the other entries are candidate prefixes."""
    from kernelbay_quant_mxfp4_rocm.triton_gemm import GemmConfig

    out = []
    for name in names:
        try:
            out.append(GemmConfig.parse(name))
        except ValueError:
            continue
    return out


def _w4a4(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, top: int) -> Any:
    from kernelbay_quant_mxfp4_rocm import triton_mx
    from kernelbay_quant_mxfp4_rocm.triton_gemm import mxfp4_gemm

    def run() -> torch.Tensor:
        xq, xs = triton_mx.quantize_mx(x, "e2m1", "even")
        return mxfp4_gemm(xq, packed, scales, x_scale=xs, scale_max=top)

    return run


def _programmatic() -> bool:
    """Whether this run's Triton kernels went out as programmatic dependents."""
    if DEVICE["name"] != "cuda":
        return False
    from kernelbay import triton_pdl

    return triton_pdl.enabled(torch.device("cuda", torch.cuda.current_device()))


def markdown(result: dict[str, Any]) -> str:
    """The results table."""
    sweep = result["configs"] == "all"
    lines = [
        f"# MXFP4 GEMM ({result['method']}) vs torch bf16 matmul",
        "",
        f"{result['gpu']}, torch {result['torch']}, triton {result['triton']}, "
        f"{result['date']}; {result['timing']}; programmatic launches "
        f"{'on' if result.get('programmatic_launches') else 'off'} (KERNELBAY_PDL). "
        "ratio = bf16 time / mxfp4 time (> 1: faster).",
        "",
        "| N | K | M | bf16 us | mxfp4 us | ratio | mxfp4 GB/s | bf16 GB/s | W4A4 us | config |"
        + (" best config | best us |" if sweep else ""),
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"
        + (" --- | ---: |" if sweep else ""),
    ]
    for r in result["rows"]:
        line = (f"| {r['N']} | {r['K']} | {r['M']} | {r['bf16_us']:.1f} | {r['mxfp4_us']:.1f} "
                f"| {r['ratio']:.2f} | {r['mxfp4_GBps']:.0f} | {r['bf16_GBps']:.0f} "
                f"| {r['w4a4_us']:.1f} | {r['default_config']} |")
        if sweep:
            line += f" {r.get('best_config', '-')} | {r.get('best_us', float('nan')):.1f} |"
        lines.append(line)
    if result.get("sweep_cut_by_budget"):
        lines += ["", "The config sweep stopped at --budget seconds; later shapes are partial."]
    if result.get("wrong"):
        lines += ["", "WRONG RESULTS: " + "; ".join(result["wrong"])]
    if result.get("failed"):
        lines += ["", "FAILED MEASUREMENTS (NaN in the table):", ""]
        lines += [f"- {f}" for f in result["failed"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
