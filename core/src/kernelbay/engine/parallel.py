"""Tensor-parallel state of this process: rank, world size, group, and its collective."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, final

__all__ = ["TensorParallel", "init_tensor_parallel"]


@final
@dataclass
class TensorParallel:
    """This rank's place in the tensor-parallel group. ``collective`` is the selected
    collective backend instance (``None`` when ``size == 1``); ``gemm_collective`` the one
    selected for GEMM + all-reduce when it fuses the two (``fuses_gemm``), else ``None``
    and row-parallel layers run their method's GEMM, then ``collective.all_reduce``;
    ``gather_collective`` the one selected for all-gather (a backend chosen for all-reduce
    need not implement the other operations)."""

    rank: int = 0
    size: int = 1
    group: Any = None
    collective: Any = None
    gemm_collective: Any = None
    gather_collective: Any = None

    def shard_range(self, total: int) -> tuple[int, int]:
        """[start, end) of this rank's rows when ``total`` rows are split in ceil-sized
        chunks (the last rank may hold fewer real rows; the rest is padding)."""
        chunk = -(-total // self.size)
        start = min(self.rank * chunk, total)
        return start, min(start + chunk, total)


def init_tensor_parallel(size: int, device_type: str) -> TensorParallel:
    """Join (or start) the default process group for ``size`` ranks, as ``torchrun`` sets up.

    gloo on CPU, NCCL on GPU. ``size == 1`` needs no process group.
    """
    if size == 1:
        return TensorParallel()
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "0"))
    if world != size:
        raise RuntimeError(f"tensor_parallel_size={size} needs {size} processes launched with "
                           f"torchrun (--nproc-per-node {size}); WORLD_SIZE is "
                           f"{os.environ.get('WORLD_SIZE')!r}")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    return TensorParallel(dist.get_rank(), dist.get_world_size(), None)
