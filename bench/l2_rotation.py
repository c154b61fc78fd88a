"""Timing weights from HBM: rotate over enough weight copies that one call's weight cannot
still be in the L2 from the previous call (a decode step reads each layer's weight once, after
every other layer's), for the benchmarks that time weight streaming kernels."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

#: L2 of the largest part this is run on (H100 / H200: 50 MB).
L2_BYTES = 50 << 20


def copies_for(bytes_each: int) -> int:
    """Weight copies to rotate over so a method's working set exceeds 2 x L2."""
    return max(1, -(-2 * L2_BYTES // bytes_each))


def rotating(fns: Sequence[Callable[..., Any]]) -> Callable[[], Any]:
    """One callable that runs the next of ``fns`` each call (a different weight copy)."""
    state = [0]

    def call() -> Any:
        fn = fns[state[0] % len(fns)]
        state[0] += 1
        return fn()

    return call
