"""Tuning helper: every kernel path of kernelbay-cpu-amx against bf16 ``F.linear``, per M.

Use it to set ``kernels.DECODE_MAX_M`` / ``kernels.AMX_MIN_M`` on a new CPU: for each M it
times (interleaved, weights rotated past the last-level cache) ``F.linear`` on bf16 weights,
the FP8 decode and tiled paths for each conversion the CPU runs, the tiled path on AMX tiles
when usable, and the bf16-weight kernels. Prints a table; writes nothing.

    python bench/cpu_fp8/tune.py --n 4096 --k 4096 --ms 1 16 32 64 128 256 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from kernelbay_cpu_amx import kernels


def make_calls(x: torch.Tensor, fp8: list[kernels.PackedLinear],
               bf16: list[kernels.PackedLinear], dense: list[torch.Tensor], convs: list[str],
               amx: bool) -> dict[str, Callable[[], object]]:
    """One timed callable per path; each call takes the next weight copy."""
    turn = [0]

    def pick(items: list[kernels.PackedLinear]) -> kernels.PackedLinear:
        turn[0] = (turn[0] + 1) % len(items)
        return items[turn[0]]

    def fp8_call(path: str, conv: str, use_amx: bool) -> Callable[[], object]:
        return lambda: kernels.linear(pick(fp8), x, path=path, use_amx=use_amx, conv=conv)

    def bf16_call(path: str, use_amx: bool) -> Callable[[], object]:
        return lambda: kernels.linear(pick(bf16), x, path=path, use_amx=use_amx)

    calls: dict[str, Callable[[], object]] = {
        "F.linear": lambda: F.linear(x, dense[turn[0] % len(dense)]),
    }
    for conv in convs:
        calls[f"fp8 decode/{conv}"] = fp8_call("decode", conv, False)
        calls[f"fp8 tiled/{conv}"] = fp8_call("tiled", conv, False)
        if amx:
            calls[f"fp8 amx/{conv}"] = fp8_call("tiled", conv, True)
    calls["bf16 decode"] = bf16_call("decode", False)
    calls["bf16 tiled"] = bf16_call("tiled", False)
    if amx:
        calls["bf16 amx"] = bf16_call("tiled", True)
    return calls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--ms", type=int, nargs="+", default=[1, 16, 32, 64, 128, 256])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--working-set-mb", type=int, default=128)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    n, k = args.n, args.k
    gen = torch.Generator().manual_seed(0)
    q = (torch.randn(n, k, generator=gen) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-n // 128), k // 128, generator=gen) + 0.01
    copies = max(1, (args.working_set_mb << 20) // (n * k))
    fp8 = [kernels.PackedLinear(kernels.pack_weight(q.clone()),
                                kernels.scale_operand(scale, (128, 128)), (128, 128), None, n, k)
           for _ in range(copies)]
    half = max(1, copies // 2)
    dense = [q.to(torch.bfloat16) for _ in range(half)]
    bf16 = [kernels.PackedLinear(kernels.pack_weight(w), torch.ones(()), None, None, n, k)
            for w in dense]
    convs = ["int", "vbmi"] if kernels.vbmi_usable() else ["int"]
    amx = kernels.amx_usable()
    print(f"N={n} K={k} threads={torch.get_num_threads()} conversions={convs} amx={amx}")
    for m in args.ms:
        calls = make_calls(torch.randn(m, k, generator=gen).to(torch.bfloat16), fp8, bf16,
                           dense, convs, amx)
        times: dict[str, list[float]] = {name: [] for name in calls}
        for fn in calls.values():
            fn()
        for _ in range(args.reps):
            for name, fn in calls.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        base = med["F.linear"]
        cells = "  ".join(f"{name} {t * 1e3:.3f}ms ({base / t:.2f}x)" for name, t in med.items())
        print(f"M={m:4d}  {cells}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
