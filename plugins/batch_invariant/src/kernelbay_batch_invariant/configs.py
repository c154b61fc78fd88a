"""Tiling of the batch-invariant matmul: a table keyed by (N, K, dtype), never by M, and
the pipeline depth chosen from the device's shared-memory limit.

Why the tiling must not depend on M: each output element is a sum over K; the order of that
sum is fixed by BLOCK_K, by the kernel's fixed loop over K tiles and, with split-K, by the
fixed K slices (whole BLOCK_K tiles, ``kernels.split_ranges``) whose fp32 partials a second
kernel adds in slice order. If M picked any of these, a row computed in a batch of 1 and in a
batch of 256 could be summed in different orders and differ in the last bit. BLOCK_M, BLOCK_N
and GROUP_M only decide which program computes a row, not how the row is summed; BLOCK_M is
still kept to one value per (N, K) so that the compiled dot (its MMA instruction shape) is the
same kernel for every M.

Reasoning for the table (H200: 132 SMs, 228 KB shared memory per SM; GPU sweeps of
``bench/batch_invariant``, CUDA-graph timing over weight copies past 2x L2, ratio to cuBLAS
at M >= 64). With N = 4096 and 64..128-wide tiles there are only 32..64 column tiles, so at
M <= 128 most SMs idle unless a fixed split-K gives each tile several programs; from
``whole_from`` x SMs tiles a split config runs as whole tiles (``kernels.invariant_matmul``:
one pipelined K loop adding each slice at its end, the same bits), and in between a program
may walk several slices. Which of these runs, and the loads and pipeline depth (``whole_tma``,
``whole_stages``, ``lone_stages``), may follow M: they do not change the sums.
4096 x 4096: 64 x 128 x 64, 4 warps, split-K 4 summed by a second kernel (1.20 / 1.21 at
M = 64 / 128), whole tiles from 119 tiles (M = 256: 128 tiles, one per SM, 5 stages: 1.21;
as 512 split programs it was 1.39, with 4 stages 1.39 too) and at M = 1024 (4 stages, two
blocks per SM, GROUP_M 16: 1.21, against 1.27-1.31 with GROUP_M 8). 14336 x 4096 (224 column tiles of 64): 64 x 128 x 64 unsplit, whole
tiles through descriptor loads, 5 stages while there is at most one tile per SM (0.95 / 1.02
/ 1.18 / 1.19 at M = 64..1024; 128 x 128 x 64 with 8 warps gave 1.31-1.38), with GROUP_M 16:
at M = 1024 all 16 row tiles of a W column tile run together, so the 117 MB weight is read
from HBM once instead of twice (1.19 against 1.28 with GROUP_M 8). 4096 x 14336:
128 x 128 x 64, 8 warps, split-K 4 with descriptor loads summed by a second kernel, whole
tiles with 4 stages (1.07 / 1.05 / 1.22 / 1.19). Eight warps per whole-tile program (64 x
128 tiles) lost at M = 1024 (1.41-1.45). Shapes not in the table use
``_rule`` (BLOCK_M 64, BLOCK_N from N, BLOCK_K 64, 32 for float32, no split).
``python bench/batch_invariant/run.py --configs all`` re-measures the candidates and prints
table lines to paste here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["DEFAULT_SHARED_MEMORY", "MatmulConfig", "choose_stages", "device_shared_memory",
           "matmul_config", "shared_memory_limit", "weight_config"]

#: Assumed shared-memory limit per block when the device cannot be asked (the CUDA default).
DEFAULT_SHARED_MEMORY = 48 * 1024
#: Bytes kept free for the kernel's own scratch (barriers, layout conversions).
_RESERVE = 2 * 1024
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class MatmulConfig:
    """One tiling of ``y = x W^T``; ``num_stages`` is the software-pipeline depth."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4
    group_m: int = 8
    #: K slices summed separately and added in slice order (1: one walk over K). A function
    #: of (N, K) like the rest of the tiling, never of M.
    split_k: int = 1
    #: With split-K: the tile's last program adds the partials (slice order, from a tile
    #: workspace in L2) instead of a second kernel. Same order, so the same bits.
    sum_in_kernel: bool = False
    #: Load the x and W tiles with Hopper's tensor memory accelerator (host tensor
    #: descriptors) instead of pointer loads: the same values reach the same dot, so the
    #: K order is unchanged. Needs K * itemsize a multiple of 16 bytes.
    tma: bool = False
    #: When the tiles run whole (as many output tiles as SMs: large M), load through tensor
    #: descriptors even if ``tma`` is off, with ``whole_stages`` pipeline stages (0: the
    #: config's own). Loads and pipelining only: the same values reach the same dots in the
    #: same K order, so the bits do not change with the mode. The two-accumulator whole-tile
    #: loop needs fewer registers with descriptor loads; the split programs may not.
    whole_tma: bool = False
    whole_stages: int = 0
    #: A split config runs as whole tiles from ``whole_from`` x (SM count) output tiles up;
    #: below, one program per (tile, slice). Only who sums changes, never the order, so it
    #: may be tuned per (N, K) like the loads: a tile count just under the SM count runs
    #: faster whole than as four times as many programs that write and re-read partials.
    whole_from: float = 1.0
    #: Pipeline stages when whole tiles are at most one per SM (0: ``whole_stages``): a lone
    #: program per SM gains nothing from room for a second one, so it may pipeline deeper.
    lone_stages: int = 0

    def stage_bytes(self, itemsize: int) -> int:
        """Shared memory one pipeline stage holds: an x tile and a W tile."""
        return (self.block_m + self.block_n) * self.block_k * itemsize


#: Tuned entries by (N, K, dtype); shapes not listed use the rule in ``matmul_config``.
#: From the H200 sweeps of this table (bench/results/batch_invariant-h200.md), worst ratio to
#: cuBLAS at M >= 64: 4096 x 4096 1.21, 14336 x 4096 1.19-1.22, 4096 x 14336 1.19-1.22.
TABLE: dict[tuple[int, int, str], MatmulConfig] = {
    (4096, 4096, "bfloat16"): MatmulConfig(64, 128, 64, 4, 4, group_m=16, split_k=4,
                                           whole_tma=True, whole_stages=4, whole_from=0.9,
                                           lone_stages=5),
    (14336, 4096, "bfloat16"): MatmulConfig(64, 128, 64, 4, 4, group_m=16, whole_tma=True,
                                            whole_stages=4, lone_stages=5),
    (4096, 14336, "bfloat16"): MatmulConfig(128, 128, 64, 8, 4, split_k=4, tma=True,
                                            whole_tma=True, whole_stages=4),
}


def _rule(n: int, dtype: str) -> MatmulConfig:
    block_k = 32 if dtype == "float32" else 64
    if n <= 16:
        block_n = 16
    elif n <= 32:
        block_n = 32
    elif n < 8192:
        block_n = 64
    else:
        block_n = 128
    return MatmulConfig(64, block_n, block_k, 4, 4)


def choose_stages(config: MatmulConfig, itemsize: int, shared_memory: int,
                  max_stages: int | None = None) -> MatmulConfig:
    """``config`` with as many pipeline stages as ``shared_memory`` bytes hold (at most
    ``max_stages``, default the config's own; at least 1). When not even one stage fits,
    BLOCK_K is halved (down to 16) until it does: the reduction order changes with it, but
    it is still a function of the device and of (N, K, dtype) alone, never of M."""
    top = max_stages if max_stages is not None else config.num_stages
    budget = shared_memory - _RESERVE
    while config.stage_bytes(itemsize) > budget and config.block_k > 16:
        config = replace(config, block_k=config.block_k // 2)
    fit = budget // config.stage_bytes(itemsize)
    whole = int(max(1, min(config.whole_stages, fit))) if config.whole_stages else 0
    lone = int(max(1, min(config.lone_stages, fit))) if config.lone_stages else 0
    return replace(config, num_stages=int(max(1, min(top, fit))), whole_stages=whole,
                   lone_stages=lone)


def matmul_config(n: int, k: int, dtype: str, shared_memory: int) -> MatmulConfig:
    """The tiling for weight [N, K] of ``dtype`` on a device with ``shared_memory`` bytes
    per block. Raises ``ValueError`` naming the dtype and the valid set."""
    if dtype not in _ITEMSIZE:
        raise ValueError(f"batch-invariant matmul: dtype {dtype!r} is not supported; valid: "
                         f"{sorted(_ITEMSIZE)}")
    base = TABLE.get((n, k, dtype)) or _rule(n, dtype)
    return choose_stages(base, _ITEMSIZE[dtype], shared_memory)


@functools.cache
def weight_config(n: int, k: int, dtype: str, device: torch.device) -> MatmulConfig:
    """``matmul_config`` for a weight [N, K] of ``dtype`` on ``device``, decided once per
    process for each such key (the shared-memory probe included)."""
    return matmul_config(n, k, dtype, device_shared_memory(device))


def device_shared_memory(device: object) -> int:
    """``shared_memory_limit`` of a CUDA ``torch.device``; ``DEFAULT_SHARED_MEMORY`` for any
    other (Triton's CPU interpreter has no limit to respect)."""
    if getattr(device, "type", None) != "cuda":
        return DEFAULT_SHARED_MEMORY
    index = getattr(device, "index", None)
    return shared_memory_limit(index if index is not None else 0)


def shared_memory_limit(device_index: int = 0) -> int:
    """Shared memory one block may use on CUDA device ``device_index`` (opt-in maximum):
    from torch's device properties, else Triton's driver, else ``DEFAULT_SHARED_MEMORY``."""
    import torch

    props = torch.cuda.get_device_properties(device_index)
    value = getattr(props, "shared_memory_per_block_optin", None)
    if value:
        return int(value)
    try:
        import triton

        info = triton.runtime.driver.active.utils.get_device_properties(device_index)
        return int(info["max_shared_mem"])
    except Exception:  # an older or different driver: the safe default
        return DEFAULT_SHARED_MEMORY
