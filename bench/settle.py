"""A pause before each timing, so that no measurement starts while the GPU still recovers from
the one before.

On the H200 a kernel timed right after a long cuBLAS bf16 GEMM ran 10-20% slower than the
same kernel timed after 0.2 s of idle (8192 x 8192, M = 128 and 256: 42-50 against 37.5 us,
60-69 against 56 us); the benchmarks that compare against cuBLAS in one run settle before
every timing, the baseline's included."""

from __future__ import annotations

import time

#: Idle seconds before each timing (0.2 s removed the effect above).
SETTLE_S = 0.25


def settle(seconds: float = SETTLE_S) -> None:
    """Wait for the GPU to finish its queued work, then idle ``seconds``."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        time.sleep(seconds)
