"""What the split combine costs the CUDA MXFP8 decode (16 heads, the memory-bound rows of
bench/mla_decode): one decode step as called (partials, then ``triton_mla._combine``), the
same without the combine (the partials written, never merged: not a valid result, a timing
only), and the combine kernel alone, in CUDA graphs after a settle (run.py's ``_time``).

    python bench/mla_decode/combine_cost.py
"""

from __future__ import annotations

import math
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
import run  # noqa: E402  (bench/mla_decode/run.py: its cache, metadata and timing helpers)
from settle import SETTLE_S  # noqa: E402  (from bench/)

CASES = ((16, 8192), (64, 8192), (128, 8192), (16, 32768), (64, 32768), (128, 32768))
HEADS = 16


def time_case(batch: int, context: int) -> str:
    """One line: the decode step as called, without the combine, and the combine alone (us),
    with the split count it ran."""
    from kernelbay_attn_flashmla import triton_mla

    gen = torch.Generator().manual_seed(batch + context)
    cache = run._build_cache("mxfp8", context, batch, gen)
    meta = run._metadata(batch, context, cache["tables"])
    query = torch.randn(batch, HEADS, cache["record"].latent_dim, device="cuda",
                        dtype=torch.bfloat16)
    scale = 1 / math.sqrt(192)

    def step() -> None:
        triton_mla.mla_decode(query, cache["cache"], cache["record"], run.PAGE, meta, scale,
                              kernel="cuda")

    real = triton_mla._combine
    us = {}
    try:
        for label, combine in (("as called", real), ("without the combine", None)):
            triton_mla._combine = combine or (lambda part, plse, out, lse, splits: None)
            step()
            us[label] = 1e3 * run._time(step, 40, False, SETTLE_S)
    finally:
        triton_mla._combine = real
    splits, _ = triton_mla.last_splits()
    if splits is None or splits < 2:
        return f"batch {batch}, {context} keys: {splits} split(s), nothing to combine"
    rank = cache["record"].kv_lora_rank
    out = torch.empty(batch, HEADS, rank, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(batch, HEADS, device="cuda")
    part = torch.randn(batch, splits, HEADS, rank, device="cuda")
    plse = torch.randn(batch, splits, HEADS, device="cuda")
    us["combine alone"] = 1e3 * run._time(lambda: real(part, plse, out, lse, splits), 40,
                                          False, SETTLE_S)
    return (f"batch {batch}, {context} keys, {splits} splits: "
            + ", ".join(f"{label} {t:.1f} us" for label, t in us.items()))


def main() -> int:
    for batch, context in CASES:
        print(time_case(batch, context), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
