"""Sparse top-k MLA decode (DeepSeek-V3.2 style): each query token attends the K positions its
top-k list names, out of a long context.

For record kind x batch x context x query heads it runs the Triton kernel and, where it reads
the kind (``cuda_mla.KINDS``), the CUDA kernel on the same
random lists (distinct positions), checks both against the torch reference on the first
``CHECK_SEQS`` sequences, and times one decode step as CUDA-graph replays (decode and
combine). KV TB/s counts the K records each token reads; x bf16 is the bf16-record time (the
Triton kernel, the only one that reads bf16 records) over this one, same run.

    python bench/mla_decode/sparse.py --out DIR          # about a minute on the H200
    python bench/mla_decode/sparse.py --sweep --out DIR  # and the CUDA builds of SWEEP
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import write_results  # from bench/, put on the path above
from run import PAGE, _build_cache, _metadata  # the dense benchmark's cache and tables
from settle import add_timing_args, timed_us

KINDS = ("bf16", "fp8", "mxfp8", "fp8-e8m0")
#: CUDA builds ``--sweep`` times beside the call's own (``cuda_mla.build_for`` options): keys
#: per tile, stages (tiles in flight), CTAs per SM compiled for, query slices in shared memory.
SWEEP: tuple[dict[str, Any], ...] = tuple(
    {"tile": t, "stages": s, "min_blocks": b, "query_in_shared": q}
    for t, s, b, q in ((32, 2, 3, True), (32, 3, 2, False), (32, 4, 2, False),
                       (32, 3, 3, True), (16, 3, 3, False), (16, 4, 3, False),
                       (16, 6, 2, False), (16, 4, 4, True)))
CHECK_SEQS = 2
ATOL = 3e-2


def _lists(batch: int, context: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """``[batch, k]`` distinct random positions of each sequence (int32, on the GPU)."""
    return torch.argsort(torch.rand(batch, context, generator=gen), dim=1)[:, :k].int().cuda()


def _error(record: Any, cache: torch.Tensor, meta: Any, query: torch.Tensor,
           topk: torch.Tensor, out: torch.Tensor, scale: float) -> float:
    """Largest |kernel - reference| / (1 + |reference|) over the first ``CHECK_SEQS``
    sequences."""
    from kernelbay.layers import AttentionMetadata
    from kernelbay_attn_flashmla.mla import mla_attention

    n = min(CHECK_SEQS, query.shape[0])
    sub = AttentionMetadata(meta.query_start_loc[:n + 1], meta.seq_lens[:n],
                            meta.block_tables[:n], meta.slot_mapping[:n])
    ref, _ = mla_attention(query[:n], cache, record, PAGE, sub, scale, topk_indices=topk[:n])
    got = out[:n].float()
    if not bool(torch.isfinite(got).all()):
        return math.inf
    return float(((got - ref.float()).abs() / (1 + ref.float().abs())).max())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--batches", default="16,64,128")
    parser.add_argument("--contexts", default="32768")
    parser.add_argument("--heads", default="16,128")
    parser.add_argument("--topk", type=int, default=2048, help="positions per top-k list")
    parser.add_argument("--sweep", action="store_true",
                        help="also time the CUDA builds of SWEEP (second table)")
    add_timing_args(parser, rep_ms=20.0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("sparse: needs a CUDA device", file=sys.stderr)
        return 2
    from kernelbay_attn_flashmla import cuda_mla
    from kernelbay_attn_flashmla.triton_mla import last_kernel, last_splits, mla_decode

    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    heads_list = [int(h) for h in args.heads.split(",")]
    kinds = args.kinds.split(",")
    gen = torch.Generator().manual_seed(0)
    scale = 1 / math.sqrt(192)
    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    started = time.perf_counter()
    for context in contexts:
        for kind in kinds:
            built = _build_cache(kind, context, max(batches), gen)
            record, cache = built["record"], built["cache"]
            for batch in batches:
                meta = _metadata(batch, context, built["tables"][:batch])
                topk = _lists(batch, context, args.topk, gen)
                for heads in heads_list:
                    query = torch.randn(batch, heads, record.latent_dim, generator=gen).to(
                        "cuda", torch.bfloat16)
                    runs: list[tuple[str, dict[str, Any] | None]] = [("triton", None)]
                    if kind in cuda_mla.KINDS:
                        runs.append(("cuda", None))
                        if args.sweep:
                            runs += [("cuda", build) for build in SWEEP]
                    for kernel, build in runs:
                        step = functools.partial(mla_decode, query, cache, record, PAGE,
                                                 meta, scale, topk_indices=topk, kernel=kernel,
                                                 cuda_build=build)
                        out, _ = step()
                        used, splits = last_kernel(), last_splits()[0]
                        err = _error(record, cache, meta, query, topk, out, scale)
                        label = f"{kind} B={batch} ctx={context} H={heads} {kernel} {build or ''}"
                        if not err <= ATOL:
                            failures.append(f"{label}: max relative error {err:.3g} > {ATOL}")
                        us = timed_us(step, "cuda", settle_s=args.settle_s,
                                      rep_ms=args.rep_ms)
                        tb_s = batch * args.topk * record.bytes_per_token / (us * 1e-6) / 1e12
                        rows.append({"kind": kind, "batch": batch, "context": context,
                                     "heads": heads, "topk": args.topk, "kernel": used,
                                     "cuda_build": build,
                                     "splits": splits, "us": us, "kv_tb_s": tb_s,
                                     "bytes_per_token": record.bytes_per_token,
                                     "max_rel_err": err})
                        print(f"{label}: {us:.1f} us, {tb_s:.2f} TB/s, err {err:.2g}",
                              flush=True)
            del built, cache
            torch.cuda.empty_cache()
    base = {(r["batch"], r["context"], r["heads"]): r["us"] for r in rows
            if r["kind"] == "bf16"}
    for r in rows:
        key = (r["batch"], r["context"], r["heads"])
        r["x_bf16"] = base[key] / r["us"] if key in base else None
    props = torch.cuda.get_device_properties(0)
    lines = [f"# Sparse top-k MLA decode, {props.name}", "",
             f"One decode step, top-k {args.topk} distinct random positions per token, page "
             f"{PAGE}, CUDA-graph replays after {args.settle_s} s idle; KV TB/s counts the "
             f"top-k records of each token; x bf16 = bf16 records (Triton) / this time, same "
             f"run. `python bench/mla_decode/sparse.py --out DIR`.", "",
             "| kind | B/token | batch | context | heads | kernel | splits | us | KV TB/s "
             "| x bf16 |", "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: "
             "| ---: |"]
    for r in rows:
        if r["cuda_build"] is not None:
            continue  # the sweep's table below
        ratio = f"{r['x_bf16']:.2f}" if r["x_bf16"] is not None else "-"
        lines.append(f"| {r['kind']} | {r['bytes_per_token']} | {r['batch']} | {r['context']} "
                     f"| {r['heads']} | {r['kernel']} | {r['splits']} | {r['us']:.1f} "
                     f"| {r['kv_tb_s']:.2f} | {ratio} |")
    swept = [r for r in rows if r["cuda_build"] is not None]
    if swept:
        lines += ["", "CUDA builds (`--sweep`; the table above uses the call's preferred "
                  "build):", "", "| kind | batch | heads | tile | stages | CTAs/SM | query in "
                  "shared | us | x bf16 |", "| --- | ---: | ---: | ---: | ---: | ---: | --- | "
                  "---: | ---: |"]
        for r in swept:
            b = r["cuda_build"]
            lines.append(f"| {r['kind']} | {r['batch']} | {r['heads']} | {b['tile']} | "
                         f"{b['stages']} | {b['min_blocks']} | {b['query_in_shared']} | "
                         f"{r['us']:.1f} | {r['x_bf16']:.2f} |")
    result = {"meta": {"device": props.name, "torch": torch.__version__, "topk": args.topk,
                       "page_size": PAGE, "seconds": time.perf_counter() - started,
                       "failures": failures},
              "rows": rows}
    return write_results(args.out, result, "\n".join(lines) + "\n", failures)


if __name__ == "__main__":
    sys.exit(main())
