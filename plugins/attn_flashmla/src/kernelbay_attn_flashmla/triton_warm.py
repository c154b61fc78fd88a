"""Compile ``mla-triton`` kernel configurations ahead, several at once, in worker processes.

Each Triton compile of the decode kernel takes seconds of one CPU core; a run that needs
many (the GPU tests, a sweep) spends most of its time compiling one after the other. Each
job here runs one configuration once on a tiny cache in a spawned process, which leaves the
compiled kernel in Triton's on-disk cache; the calling process then loads it instead of
compiling. Imports torch and triton (only when used); needs a CUDA device.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

__all__ = ["WarmJob", "warm", "warm_one"]

PAGE = 64


class WarmJob(NamedTuple):
    """One configuration: the record (kind and dims), query heads, ``mla_decode`` launch
    keywords, the split count (1: the split kernel writes the final output, a different
    compile from the partials of > 1) and whether to compile the cache write too."""

    kind: str
    kv_lora_rank: int
    rope_dim: int
    heads: int
    launch: dict[str, Any]
    splits: int = 2
    write: bool = False


def warm_one(job: WarmJob) -> str:
    """Compile ``job`` by running it once; returns an error text, or '' on success."""
    try:
        import torch
        from kernelbay.layers import AttentionMetadata

        from kernelbay_attn_flashmla.records import record_for_dims
        from kernelbay_attn_flashmla.triton_mla import mla_decode, mla_write

        record = record_for_dims(job.kind, job.kv_lora_rank, job.rope_dim)
        cache = torch.zeros(2, record.page_bytes(PAGE), dtype=torch.uint8, device="cuda")
        if job.write:
            latent = torch.zeros(1, record.latent_dim, dtype=torch.bfloat16, device="cuda")
            mla_write(cache, record, PAGE, latent, torch.zeros(1, dtype=torch.long,
                                                               device="cuda"))
        tables = torch.arange(2, dtype=torch.int32, device="cuda").view(1, 2)
        meta = AttentionMetadata(torch.tensor([0, 1], dtype=torch.int32, device="cuda"),
                                 torch.tensor([2 * PAGE], dtype=torch.int32, device="cuda"),
                                 tables, torch.zeros(1, device="cuda"))
        query = torch.zeros(1, job.heads, record.latent_dim, dtype=torch.bfloat16,
                            device="cuda")
        mla_decode(query, cache, record, PAGE, meta, 0.1,
                   **dict(job.launch, num_splits=job.splits))
        torch.cuda.synchronize()
        return ""
    except Exception as exc:  # reported to the caller; the real launch compiles and fails
        return f"{job}: {type(exc).__name__}: {str(exc)[:200]}"


def warm(jobs: list[WarmJob], workers: int | None = None) -> list[str]:
    """Compile ``jobs`` in ``workers`` processes at once (default: the CPU count, at most
    12); returns the errors (none when nothing could be started: the launches then compile
    on first use as usual)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    workers = min(workers or min(12, os.cpu_count() or 1), len(jobs))
    if workers <= 1:
        return []
    # An executor, not a Pool: a worker that dies fails its jobs instead of hanging the run.
    try:
        with ProcessPoolExecutor(workers,
                                 mp_context=multiprocessing.get_context("spawn")) as pool:
            return [e for e in pool.map(warm_one, jobs, timeout=300) if e]
    except Exception as exc:
        return [f"precompiling stopped: {type(exc).__name__}: {str(exc)[:200]}"]
