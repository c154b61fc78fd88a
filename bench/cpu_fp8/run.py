"""Benchmark: FP8 W8A16 linear (kernelbay-cpu-amx) against bf16 baselines on this CPU.

For each (N, K) and M it times, interleaved in one run (so machine noise hits all alike):

* ``bf16``: ``torch.nn.functional.linear`` on bf16 weights (the baseline of every ratio),
* ``dequant``: dequantize the FP8 weight through ``kernelbay.formats.fp8`` to bf16 on every
  call, then ``F.linear`` (what a W8A16 layer costs without a kernel),
* ``fp8``: ``cpu-fp8-avx512`` (per-block 128 x 128 scales, its default path choice),
* ``bf16-packed``: ``cpu-bf16-avx512``, the same kernels on unquantized bf16 weights.

Reported: median time per call, ratio vs ``bf16`` (> 1 is faster; the median of per-rep
ratios, each rep timing every method back to back), and GB/s of weight bytes
(E4M3 bytes + fp32 scales for ``fp8``, 2 bytes per weight for the bf16 ones; for ``dequant``
the FP8 bytes it reads). Weights rotate over enough copies that each method's working set
exceeds twice the last-level cache: decode is measured from DRAM, as in a real model whose
layers do not fit in cache.

    python bench/cpu_fp8/run.py              # full grid, 2 threads -> results.json, results.md
    python bench/cpu_fp8/run.py --quick      # CI smoke: one small shape, two M, few reps

On a shared machine each measurement first waits (``--patience`` seconds at most) until
other processes use under 10% of the CPUs (the reading is kept in ``cpu_busy_before``), and
drops every rep during which another process was runnable (``clean_reps`` counts the rest;
a cell with fewer than 5 is measured again, up to 3 times).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from kernelbay.device import CPU_FLAGS_OF_INTEREST, DeviceCapability, probe_device
from kernelbay.formats.fp8 import dequantize_fp8_per_block, quantize_fp8_per_block
from kernelbay.requests import LayerRole, LinearRequest, QuantScheme
from kernelbay_cpu_amx import kernels
from kernelbay_cpu_amx.linear import CpuBf16Avx512Linear, CpuFp8Avx512Linear

SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336))
MS = (1, 4, 16, 64, 256)
QUICK_SHAPES = ((1024, 1024),)
QUICK_MS = (1, 64)
BLOCK = (128, 128)
METHODS = ("bf16", "dequant", "fp8", "bf16-packed")
HERE = Path(__file__).resolve().parent


def host_cpu() -> DeviceCapability:
    """The host CPU's facts, also on a machine whose probed device is a GPU."""
    device = probe_device()
    if device.platform == "cpu":
        return device
    flags: frozenset[str] = frozenset()
    name = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags") and not flags:
                    flags = frozenset(line.split(":", 1)[1].split()) & CPU_FLAGS_OF_INTEREST
                elif line.startswith("model name") and not name:
                    name = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return DeviceCapability("cpu", platform.machine(), None, flags, name)


def last_level_cache_bytes() -> int:
    """Size of the largest CPU cache (sysfs), or 32 MiB when it cannot be read."""
    best = 0
    root = Path("/sys/devices/system/cpu/cpu0/cache")
    for index in root.glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text[:-1] if text[-1:] in "KMG" else text
        if digits.isdigit():
            best = max(best, int(digits) * scale)
    return best or 32 << 20


class Layer(torch.nn.Module):
    """A bare module holding one linear method's parameters."""


def build_fp8(n: int, k: int, q: torch.Tensor, s: torch.Tensor) -> tuple[Layer, Any]:
    scheme = QuantScheme("fp8-block", "float8_e4m3fn", BLOCK, "float32")
    method = CpuFp8Avx512Linear(LinearRequest(k, n, scheme, "bfloat16", role=LayerRole.OTHER))
    layer = Layer()
    method.create_weights(layer)
    layer.weight.data.copy_(q)
    layer.weight_scale.data.copy_(s)
    method.process_weights_after_loading(layer)
    return layer, method


def build_bf16_packed(n: int, k: int, w: torch.Tensor) -> tuple[Layer, Any]:
    method = CpuBf16Avx512Linear(LinearRequest(k, n, activation_dtype="bfloat16"))
    layer = Layer()
    method.create_weights(layer)
    layer.weight.data.copy_(w)
    method.process_weights_after_loading(layer)
    return layer, method


def path_of(method: str, m: int) -> str:
    """The kernel path ``method`` takes for ``m`` rows (empty for the torch baselines)."""
    if method == "fp8":
        kind = "vbmi" if kernels.vbmi_usable() else "int"
    elif method == "bf16-packed":
        kind = "bf16"
    else:
        return ""
    amx = kernels.amx_usable()
    path = kernels.choose_path(m, kind, amx)
    return f"{path}+amx" if amx and path == "tiled" else path


def cpu_busy(seconds: float = 0.5) -> float:
    """Fraction of all CPUs busy over ``seconds`` (from /proc/stat; 0.0 where unreadable)."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat", encoding="utf-8") as f:
            values = [int(v) for v in f.readline().split()[1:]]
        return sum(values), values[3] + values[4]  # total, idle + iowait

    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return 0.0
    return 1.0 - (idle1 - idle0) / max(1, total1 - total0)


def wait_for_quiet(limit: float, patience_s: float) -> float:
    """Wait (up to ``patience_s``) until other processes use under ``limit`` of the CPUs:
    on a shared machine a neighbour's job skews every timing. Returns the last reading."""
    deadline = time.monotonic() + patience_s
    busy = cpu_busy()
    while busy > limit and time.monotonic() < deadline:
        time.sleep(2.0)
        busy = cpu_busy()
    return busy


def copies_for(bytes_each: int, llc: int) -> int:
    """Copies of a weight to rotate over so the working set exceeds 2 x the LLC."""
    return max(1, -(-2 * llc // bytes_each))


def runnable_tasks() -> int | None:
    """Tasks runnable right now on the whole machine (/proc/loadavg), or None."""
    try:
        with open("/proc/loadavg", encoding="utf-8") as f:
            return int(f.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return None


def measure(calls: dict[str, Callable[[], object]], reps: int,
            budget_s: float) -> tuple[dict[str, list[float]], int]:
    """Seconds per call of each callable, interleaved rep by rep (order alternating).

    A rep during which another process was runnable (more runnable tasks than our threads
    plus one, sampled after every call) is dropped, so a neighbour's job does not skew the medians.
    Returns the clean reps' times (all reps if fewer than 3 were clean) and the clean count.
    """
    for fn in calls.values():  # warm up (first-touch, kernel build, oneDNN primitives)
        fn()
        fn()
    threads = torch.get_num_threads()
    clean: dict[str, list[float]] = {name: [] for name in calls}
    every: dict[str, list[float]] = {name: [] for name in calls}
    start = time.perf_counter()
    for rep in range(reps):
        order = list(calls.items())
        if rep % 2:
            order.reverse()
        contended = False
        took: dict[str, float] = {}
        for name, fn in order:
            t0 = time.perf_counter()
            fn()
            took[name] = time.perf_counter() - t0
            tasks = runnable_tasks()
            # Our threads plus one (a spinning pool worker, a kernel thread) is normal here.
            contended = contended or (tasks is not None and tasks > threads + 1)
        for name, dt in took.items():
            every[name].append(dt)
            if not contended:
                clean[name].append(dt)
        if rep >= 4 and time.perf_counter() - start > budget_s:
            break
    count = len(next(iter(clean.values())))
    return (clean if count >= 3 else every), count


def bench_shape(n: int, k: int, ms: tuple[int, ...], reps: int, budget_s: float,
                llc: int, seed: int, patience_s: float) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(seed)
    dense = torch.randn(n, k, generator=gen) * k ** -0.5
    q, s = quantize_fp8_per_block(dense, BLOCK)
    w_bf16 = dequantize_fp8_per_block(q, s, BLOCK, torch.bfloat16)
    fp8_copies = copies_for(n * k, llc)
    bf16_copies = copies_for(2 * n * k, llc)
    fp8_layers = [build_fp8(n, k, q, s) for _ in range(fp8_copies)]
    packed_layers = [build_bf16_packed(n, k, w_bf16) for _ in range(bf16_copies)]
    bf16_weights = [w_bf16.clone() for _ in range(bf16_copies)]
    raw = [(q.clone(), s.clone()) for _ in range(fp8_copies)]
    scale_bytes = s.numel() * 4
    rows = []
    def make_calls(x: torch.Tensor) -> dict[str, Callable[[], object]]:
        turn = dict.fromkeys(METHODS, 0)

        def nxt(name: str, count: int) -> int:
            turn[name] = (turn[name] + 1) % count
            return turn[name]

        def run_method(pair: tuple[Layer, Any]) -> object:
            return pair[1].apply(pair[0], x)

        return {
            "bf16": lambda: F.linear(x, bf16_weights[nxt("bf16", bf16_copies)]),
            "dequant": lambda: F.linear(x, dequantize_fp8_per_block(
                *raw[nxt("dequant", fp8_copies)], BLOCK, torch.bfloat16)),
            "fp8": lambda: run_method(fp8_layers[nxt("fp8", fp8_copies)]),
            "bf16-packed": lambda: run_method(packed_layers[nxt("bf16-packed", bf16_copies)]),
        }

    for m in ms:
        calls = make_calls(torch.randn(m, k, generator=gen).to(torch.bfloat16))
        for _attempt in range(3):  # a cell measured mostly under contention is redone
            busy_before = wait_for_quiet(0.1, patience_s)
            times, clean_reps = measure(calls, reps, budget_s)
            if clean_reps >= 5:
                break
        med = {name: statistics.median(ts) for name, ts in times.items()}
        weight_bytes = {"bf16": 2 * n * k, "dequant": n * k + scale_bytes,
                        "fp8": n * k + scale_bytes, "bf16-packed": 2 * n * k}
        for name in METHODS:
            rows.append({
                "N": n, "K": k, "M": m, "method": name,
                "median_ms": med[name] * 1e3,
                # Paired per rep (bf16 and this method timed back to back), then the median:
                # a neighbour's burst slows both sides of a pair and cancels out.
                "ratio_vs_bf16": statistics.median(
                    b / t for b, t in zip(times["bf16"], times[name], strict=True)),
                "reps": len(times[name]),
                "clean_reps": clean_reps,
                "weight_GBps": weight_bytes[name] / med[name] / 1e9,
                "path": path_of(name, m),
                "cpu_busy_before": round(busy_before, 3),
            })
        summary = "  ".join(f"{r['method']} {r['median_ms']:.3f} ms ({r['ratio_vs_bf16']:.2f}x)"
                            for r in rows[-len(METHODS):])
        print(f"N={n} K={k} M={m}: {summary}", flush=True)
    return rows


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        "# FP8 W8A16 linear on CPU (kernelbay-cpu-amx)",
        "",
        f"{meta['cpu']}, {meta['threads']} threads, torch {meta['torch']}, "
        f"AVX512 conversion {meta['conversion']}, AMX {'used' if meta['amx'] else 'not used'}; "
        f"{meta['date']}. Command: `{meta['command']}`.",
        "",
        "Median ms per call; x = speed vs bf16 `F.linear` (> 1 is faster; median of per-rep "
        "ratios); GB/s = weight bytes "
        "read per second. Weights rotate over copies larger than 2x the last-level cache. "
        "Methods are timed interleaved (reps during which another process ran are dropped)"
        + (", each measurement after waiting for other processes to go quiet."
           if meta.get("patience_s") else "."),
        "",
        "| N | K | M | bf16 ms | fp8 ms | fp8 x | fp8 GB/s | dequant+mm ms | dequant x "
        "| bf16-packed ms | bf16-packed x |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    by_key: dict[tuple[int, int, int], dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_key.setdefault((r["N"], r["K"], r["M"]), {})[r["method"]] = r
    for (n, k, m), got in by_key.items():
        b, f, d, p = got["bf16"], got["fp8"], got["dequant"], got["bf16-packed"]
        lines.append(
            f"| {n} | {k} | {m} | {b['median_ms']:.3f} | {f['median_ms']:.3f} | "
            f"{f['ratio_vs_bf16']:.2f} | {f['weight_GBps']:.1f} | {d['median_ms']:.3f} | "
            f"{d['ratio_vs_bf16']:.2f} | {p['median_ms']:.3f} | {p['ratio_vs_bf16']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="CI smoke: one small shape")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--reps", type=int, default=30, help="timed calls per method (max)")
    parser.add_argument("--budget", type=float, default=20.0,
                        help="seconds of timing per (shape, M) before stopping early")
    parser.add_argument("--out", type=Path, default=HERE, help="folder for results.*")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--patience", type=float, default=120.0,
                        help="seconds to wait for other processes to go quiet before each "
                             "measurement (0: never wait)")
    args = parser.parse_args(argv)

    device = host_cpu()
    if not CpuFp8Avx512Linear.can_implement(
            LinearRequest(1024, 1024, QuantScheme("fp8-block", "float8_e4m3fn", BLOCK,
                                                  "float32")), device):
        print(f"cpu-fp8-avx512 does not run on {device.describe()}: nothing to measure",
              file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    shapes = QUICK_SHAPES if args.quick else SHAPES
    ms = QUICK_MS if args.quick else MS
    reps = min(args.reps, 5) if args.quick else args.reps
    patience = 0.0 if args.quick else args.patience
    llc = last_level_cache_bytes()
    ext = kernels.extension()
    meta = {
        "cpu": device.name or platform.processor(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "conversion": "vbmi-tables" if ext.vbmi_supported() else "integer",
        "amx": kernels.amx_usable(),
        "llc_bytes": llc,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(["python bench/cpu_fp8/run.py",
                             *(sys.argv[1:] if argv is None else argv)]).strip(),
        "patience_s": patience,
        "decode_max_m": kernels.DECODE_MAX_M,
        "amx_min_m": kernels.AMX_MIN_M,
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    rows: list[dict[str, Any]] = []
    for n, k in shapes:
        rows += bench_shape(n, k, ms, reps, args.budget, llc, args.seed, patience)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "results_quick" if args.quick else "results"
    (args.out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (args.out / f"{stem}.md").write_text(markdown(rows, meta))
    print(f"wrote {args.out / stem}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
