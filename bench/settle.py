"""A pause before each timing, so that no measurement starts while the GPU still recovers from
the one before.

On the H200 a kernel timed right after a long cuBLAS bf16 GEMM ran 10-20% slower than the
same kernel timed after 0.2 s of idle (8192 x 8192, M = 128 and 256: 42-50 against 37.5 us,
60-69 against 56 us); the benchmarks that compare against cuBLAS in one run settle before
every timing, the baseline's included."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

#: Idle seconds before each timing (0.2 s removed the effect above).
SETTLE_S = 0.25


def settle(seconds: float = SETTLE_S) -> None:
    """Wait for the GPU to finish its queued work, then idle ``seconds``."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        time.sleep(seconds)


def timed_us(fn: Callable[[], Any], device: str, *, settle_s: float = SETTLE_S,
             rep_ms: float = 40.0, graph: bool = True) -> float:
    """Microseconds per call of ``fn`` after ``settle(settle_s)``: replayed from a CUDA graph
    (``triton.testing.do_bench_cudagraph``, on a side stream) or, with ``graph=False``, timed
    by CUDA events around eager calls (``do_bench``: launches and host reads included). On a
    CPU device (the scripts' interpreter checks) one warm call then one timed call: the
    number means nothing."""
    if device != "cuda":
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    import torch
    import triton.testing

    settle(settle_s)
    if graph:
        with torch.cuda.stream(torch.cuda.Stream()):
            return float(triton.testing.do_bench_cudagraph(fn, rep=rep_ms)) * 1e3
    return float(triton.testing.do_bench(fn, warmup=5, rep=rep_ms)) * 1e3


def add_timing_args(parser: argparse.ArgumentParser, rep_ms: float) -> None:
    """The options ``timed_us`` takes from a script's command line: ``--rep-ms`` (default
    ``rep_ms``), ``--settle-s``, and the hidden ``--device`` (``cpu``: checking the script's
    logic without a GPU, tiny shapes in Triton's interpreter; the times mean nothing)."""
    parser.add_argument("--rep-ms", type=float, default=rep_ms,
                        help="timing budget per measurement")
    parser.add_argument("--settle-s", type=float, default=SETTLE_S,
                        help="idle seconds before each timing (bench/settle.py)")
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
