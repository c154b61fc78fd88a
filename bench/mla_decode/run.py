"""MLA decode over paged KV records: the ``mla-triton`` kernel for every record kind.

For batch x context x query heads x record kind it times one decode step (one query token
per sequence, random page tables, page 64, splits chosen by the kernel) and reports time,
KV bytes read per second (the records of every context token, once), TFLOP/s (the two
products, 2 * H * (D + R) + 2 * H * D flops per key), and the bf16-record time over this
kind's time (the baseline, measured in the same run). Each kind uses its FORMATS.md dims
(bf16 and fp8 512+64, fp8-e8m0 and mxfp8 448+64).

Before timing, each configuration's output is checked against the torch reference
(``mla.mla_attention``) on its first ``CHECK_SEQS`` sequences; any mismatch makes the
script exit non-zero after writing the results. Times are CUDA-graph replays of the whole
decode call (split kernel and combine), metadata and per-step tables made beforehand:
the kernels' time, without Python and launch overhead (``--eager`` times plain launches).
A sweep of launch configurations (tile keys, warps, L2 prefetch, float16 dots) follows for
the memory-bound cases (16 heads, batch 64, context 8k and 32k), every record kind.

    python bench/mla_decode/run.py --out bench/mla_decode/out      # about 1 minute, H200
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from settle import settle  # from bench/, put on the path above

BATCHES = (1, 16, 64, 128)
CONTEXTS = (1024, 8192, 32768)
HEADS = (16, 128)
KINDS = ("bf16", "fp8", "fp8-e8m0", "mxfp8")
PAGE = 64
CHECK_SEQS = 2
ATOL = 3e-2
WRITE_CHUNK = 1 << 18
CHUNKED = {"auto": None, "yes": True, "no": False}
#: Launch configurations the sweep times (mla_decode keywords; unnamed ones at their
#: defaults: 2 stages, registers prefetch quantized tiles, scales applied per element,
#: records asked of L2 ``triton_mla.default_l2_ahead`` tiles ahead).
#: ``f16_dot`` (codes decoded and scaled in float16, float16 dots) only changes quantized
#: records' kernels, so bf16 runs the others.
TUNE_CONFIGS: tuple[dict, ...] = (
    {"block_n": 32, "num_warps": 8, "l2_ahead": 0},
    {"block_n": 32, "num_warps": 8, "l2_ahead": 4},
    {"block_n": 32, "num_warps": 4, "l2_ahead": 0},
    {"block_n": 32, "num_warps": 4, "l2_ahead": 4},
    {"block_n": 64, "num_warps": 8},
    {"block_n": 64, "num_warps": 8, "l2_ahead": 0},
    {"block_n": 32, "num_warps": 4, "f16_dot": True},
    {"block_n": 32, "num_warps": 4, "l2_ahead": 0, "f16_dot": True},
    {"block_n": 64, "num_warps": 8, "f16_dot": True},
    {"block_n": 32, "num_warps": 4, "chunked": True},
    {"block_n": 32, "num_warps": 8, "chunked": True},
    {"block_n": 16, "num_warps": 4, "chunked": True},
)
#: CUDA builds (the record kinds of ``cuda_mla.KINDS``) the sweep times: tiles in flight x
#: CTAs per SM compiled for, query slices in shared memory, keys per tile, bulk copies, lazy
#: max.
CUDA_TUNE: tuple[dict, ...] = tuple(
    {"kernel": "cuda", "cuda_build": {"stages": s, "min_blocks": b, "query_in_shared": q,
                                      "tile": t, "bulk_copy": k, "lazy_max": z}}
    for s, b, q, t, k, z in ((3, 4, True, 16, False, True), (3, 3, False, 16, False, True),
                             (3, 4, True, 16, True, True), (2, 4, True, 16, True, True),
                             (2, 3, False, 16, True, True), (3, 3, False, 16, True, True),
                             (3, 3, False, 16, True, False), (4, 3, False, 16, True, True),
                             (3, 2, False, 32, True, True), (2, 3, True, 32, True, True),
                             (2, 3, True, 32, True, False), (3, 3, True, 32, True, True)))
#: Split counts the sweep times at the default launch configuration (beside the kernel's
#: choice), to check the split model (``triton_mla.split_cost``) against the clock.
TUNE_SPLITS = (1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 24, 33)
#: The cases the sweep covers (16 heads: the memory-bound ones).
TUNE_BATCHES = (64,)
TUNE_CONTEXTS = (8192, 32768)


def _build_cache(kind: str, context: int, batch: int, gen: torch.Generator) -> dict:
    """Pages for ``batch`` sequences of ``context`` tokens in random page order, written by
    the Triton cache-write kernel from random latents."""
    from kernelbay_attn_flashmla.records import RECORDS
    from kernelbay_attn_flashmla.triton_mla import mla_write

    record = RECORDS[kind]
    per_seq = context // PAGE
    pages = batch * per_seq
    cache = torch.zeros(pages, record.page_bytes(PAGE), dtype=torch.uint8, device="cuda")
    order = torch.randperm(pages, generator=gen).to("cuda")
    tables = order.view(batch, per_seq).int()
    tokens = batch * context
    for begin in range(0, tokens, WRITE_CHUNK):
        n = min(WRITE_CHUNK, tokens - begin)
        idx = torch.arange(begin, begin + n, device="cuda")
        seq, pos = idx // context, idx % context
        slots = tables[seq, pos // PAGE].long() * PAGE + pos % PAGE
        latent = torch.randn(n, record.latent_dim, device="cuda", dtype=torch.bfloat16)
        mla_write(cache, record, PAGE, latent, slots)
    return {"record": record, "cache": cache, "tables": tables}


def _metadata(batch: int, context: int, tables: torch.Tensor):
    from kernelbay.layers import AttentionMetadata

    return AttentionMetadata(torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
                             torch.full((batch,), context, dtype=torch.int32, device="cuda"),
                             tables[:batch], torch.zeros(batch, device="cuda"))


def _check(record, cache, meta, query, out, scale: float) -> float:
    """Largest |kernel - reference| over the first CHECK_SEQS sequences (inf if shapes or
    finiteness differ)."""
    from kernelbay.layers import AttentionMetadata
    from kernelbay_attn_flashmla.mla import mla_attention

    n = min(CHECK_SEQS, query.shape[0])
    sub = AttentionMetadata(meta.query_start_loc[:n + 1], meta.seq_lens[:n],
                            meta.block_tables[:n], meta.slot_mapping[:n])
    ref, _ = mla_attention(query[:n], cache, record, PAGE, sub, scale)
    got = out[:n].float()
    if not bool(torch.isfinite(got).all()):
        return math.inf
    return float(((got - ref.float()).abs() / (1 + ref.float().abs())).max())


def _warm_one(job: tuple[str, int, dict]) -> str:
    """Compile one (kind, heads, launch) configuration into triton's on-disk cache by running
    it once on a tiny cache (same dtypes, alignments and constexprs as the real launches, so
    the main process then loads it instead of compiling). Returns an error text or ''."""
    kind, heads, launch = job
    try:
        from kernelbay_attn_flashmla.records import RECORDS
        from kernelbay_attn_flashmla.triton_mla import mla_decode

        record = RECORDS[kind]
        cache = torch.zeros(2, record.page_bytes(PAGE), dtype=torch.uint8, device="cuda")
        tables = torch.arange(2, dtype=torch.int32, device="cuda").view(1, 2)
        query = torch.zeros(1, heads, record.latent_dim, dtype=torch.bfloat16, device="cuda")
        mla_decode(query, cache, record, PAGE, _metadata(1, 2 * PAGE, tables), 0.1,
                   **dict(launch, num_splits=2))
        torch.cuda.synchronize()
        return ""
    except Exception as exc:  # reported by the caller; the timed run recompiles and fails
        return f"{kind} H={heads} {launch}: {type(exc).__name__}: {str(exc)[:200]}"


def _warm(jobs: list[tuple[str, int, dict]], workers: int) -> list[str]:
    """Compile ``jobs`` in ``workers`` processes at once (compiling dominates the run
    otherwise); returns the errors."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    if workers <= 1 or not jobs:
        return []
    # An executor, not a Pool: a worker that dies fails its jobs instead of hanging the run.
    try:
        with ProcessPoolExecutor(min(workers, len(jobs)),
                                 mp_context=multiprocessing.get_context("spawn")) as pool:
            return [e for e in pool.map(_warm_one, jobs, timeout=300) if e]
    except Exception as exc:  # compile on first use instead
        return [f"precompiling stopped: {type(exc).__name__}: {str(exc)[:200]}"]


def _time(fn, rep: int, eager: bool, settle_s: float) -> float:
    """Milliseconds per call of ``fn``: replayed from a CUDA graph (the kernels' own time,
    no Python or launch overhead; what an engine step captured in a graph pays), or launched
    eagerly with ``eager``; after ``settle_s`` seconds of idle GPU (``bench/settle.py``)."""
    import triton.testing

    settle(settle_s)
    if eager:
        return float(triton.testing.do_bench(fn, warmup=10, rep=rep))
    return float(triton.testing.do_bench_cudagraph(fn, rep=rep))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(Path(__file__).parent), help="output folder")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    parser.add_argument("--heads", default=",".join(map(str, HEADS)))
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--rep", type=int, default=20, help="timing rep time (ms)")
    parser.add_argument("--settle-s", type=float, default=0.25,
                        help="idle seconds before each timing (bench/settle.py)")
    parser.add_argument("--eager", action="store_true",
                        help="time eager launches (host work included) instead of CUDA-graph "
                             "replays")
    parser.add_argument("--block-n", type=int, default=None, help="keys per tile")
    parser.add_argument("--warps", type=int, default=None, help="warps per program")
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages")
    parser.add_argument("--chunked", choices=["auto", "yes", "no"], default="auto",
                        help="nope part as per-warp chunks (default: the kernel's choice)")
    parser.add_argument("--grouped", choices=["auto", "yes", "no"], default="auto",
                        help="quantized nope scaled per group after the dots (default: the "
                             "kernel's choice)")
    parser.add_argument("--l2-ahead", type=int, default=None,
                        help="tiles ahead whose records are prefetched into L2 (default: the "
                             "kernel's)")
    parser.add_argument("--kernel", choices=["auto", "triton", "cuda"], default="auto",
                        help="decode kernel (auto: the CUDA kernel for the E4M3 record kinds "
                             "where it applies, Triton elsewhere)")
    parser.add_argument("--sweep", choices=["all", "cuda"], default="all",
                        help="sweep entries: every kernel's, or the CUDA builds and split "
                             "counts only")
    parser.add_argument("--no-tune", action="store_true",
                        help="skip the launch-configuration sweep (16 heads, batch 64, "
                             "context >= 8k, every kind)")
    parser.add_argument("--jobs", type=int, default=min(12, os.cpu_count() or 1),
                        help="processes compiling the configurations before timing (1: "
                             "compile on first use)")
    parser.add_argument("--budget-s", type=float, default=90.0,
                        help="sweep entries left once the run has taken this long are "
                             "skipped (noted in the results)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("mla_decode: needs a CUDA device", file=sys.stderr)
        return 2
    from kernelbay_attn_flashmla import cuda_mla, triton_mla
    from kernelbay_attn_flashmla.records import RECORDS

    mla_decode = triton_mla.mla_decode

    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    heads_list = [int(h) for h in args.heads.split(",")]
    kinds = args.kinds.split(",")
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    gen = torch.Generator().manual_seed(0)
    rows: list[dict] = []
    notes: list[str] = []
    failures: list[str] = []
    tuning: list[dict] = []
    started = time.perf_counter()
    scale = 1 / math.sqrt(192)
    default = dict(block_n=args.block_n, num_warps=args.warps, num_stages=args.stages,
                   chunked=CHUNKED[args.chunked], grouped=CHUNKED[args.grouped],
                   l2_ahead=args.l2_ahead, kernel=args.kernel)
    jobs = [(kind, heads, default) for kind in kinds for heads in heads_list]
    if not args.no_tune and 16 in heads_list:
        jobs += [(kind, 16, _tune_launch(tune, triton_mla.default_l2_ahead(RECORDS[kind])))
                 for kind in kinds
                 for tune in TUNE_CONFIGS if not (kind == "bf16" and tune.get("f16_dot"))]
    for error in _warm(jobs, args.jobs):
        notes.append(f"precompile failed: {error}")
    print(f"compiled {len(jobs)} configurations in {time.perf_counter() - started:.0f} s",
          flush=True)
    for context in contexts:
        for kind in kinds:
            record = RECORDS[kind]
            need = max(batches) * context * record.bytes_per_token * 1.1 + (1 << 30)
            free, _ = torch.cuda.mem_get_info()
            if need > free:
                notes.append(f"skipped {kind} at context {context}: its cache needs "
                             f"{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free")
                continue
            built = _build_cache(kind, context, max(batches), gen)
            cache, tables = built["cache"], built["tables"]
            for heads in heads_list:
                for batch in batches:
                    # Metadata, split count and the kernel's per-step tables are made once,
                    # before timing (an engine step makes them once for all layers).
                    meta = _metadata(batch, context, tables)
                    query = torch.randn(batch, heads, record.latent_dim, device="cuda",
                                        dtype=torch.bfloat16)
                    label = f"{kind} B={batch} ctx={context} H={heads}"
                    err, ms = _measure(mla_decode, record, cache, meta, query, scale, default,
                                       args)
                    splits, resident = triton_mla.last_splits()
                    used_kernel = triton_mla.last_kernel()
                    if not err <= ATOL:
                        failures.append(f"{label}: max relative error {err:.3g} > {ATOL}")
                    seconds = ms * 1e-3
                    kv_bytes = batch * context * record.bytes_per_token
                    flops = 2 * batch * heads * context * (record.latent_dim
                                                           + record.kv_lora_rank)
                    rows.append({"kind": kind, "batch": batch, "context": context,
                                 "heads": heads, "dims": record.dims_text,
                                 "kernel": used_kernel,
                                 "bytes_per_token": record.bytes_per_token, "splits": splits,
                                 "resident_per_sm": resident,
                                 "ms": ms, "kv_tb_s": kv_bytes / seconds / 1e12,
                                 "tflops": flops / seconds / 1e12, "max_rel_err": err})
                    print(f"{label}: {ms:.3f} ms, {rows[-1]['kv_tb_s']:.2f} TB/s, "
                          f"{rows[-1]['tflops']:.1f} TFLOP/s, err {err:.2g}", flush=True)
                    if (args.no_tune or heads != 16 or batch not in TUNE_BATCHES
                            or context not in TUNE_CONTEXTS):
                        continue
                    sweep = [_tune_launch(tune, triton_mla.default_l2_ahead(record))
                             for tune in TUNE_CONFIGS
                             if not (kind == "bf16" and tune.get("f16_dot"))
                             and args.sweep == "all"]
                    if kind in cuda_mla.KINDS:
                        # per-thread copies take records of a multiple of 16 bytes only
                        sweep += [_tune_launch(tune, 0) for tune in CUDA_TUNE
                                  if tune["cuda_build"]["bulk_copy"]
                                  or record.bytes_per_token % 16 == 0]
                    sweep += [_tune_launch(dict(default, num_splits=n),
                                           triton_mla.default_l2_ahead(record))
                              for n in TUNE_SPLITS if n != splits]
                    for cfg in sweep:
                        cfg_label = (f"{label} kernel={cfg['kernel']} "
                                     f"cuda={cfg.get('cuda_build')} "
                                     f"splits={cfg.get('num_splits')} "
                                     f"chunked={cfg['chunked']} "
                                     f"grouped={cfg['grouped']} "
                                     f"block_n={cfg['block_n']} warps={cfg['num_warps']} "
                                     f"stages={cfg['num_stages']} "
                                     f"prefetch={cfg['reg_prefetch']} "
                                     f"l2_ahead={cfg['l2_ahead']} f16={cfg['f16_dot']}")
                        if time.perf_counter() - started > args.budget_s:
                            notes.append(f"sweep entry skipped (over --budget-s "
                                         f"{args.budget_s:.0f}): {cfg_label}")
                            continue
                        try:
                            err, t_ms = _measure(mla_decode, record, cache, meta, query, scale,
                                                 cfg, args)
                            used = triton_mla.last_splits()[0]
                        except Exception as exc:  # a config that does not compile or run
                            failures.append(f"{cfg_label}: {type(exc).__name__}: "
                                            f"{str(exc)[:200]}")
                            continue
                        if not err <= ATOL:
                            failures.append(f"{cfg_label}: max relative error {err:.3g} > "
                                            f"{ATOL}")
                        tuning.append({"kind": kind, "batch": batch, "context": context,
                                       "heads": heads, "grouped": cfg["grouped"],
                                       "block_n": cfg["block_n"], "warps": cfg["num_warps"],
                                       "stages": cfg["num_stages"],
                                       "reg_prefetch": cfg["reg_prefetch"],
                                       "l2_ahead": cfg["l2_ahead"],
                                       "f16_dot": cfg["f16_dot"], "chunked": cfg["chunked"],
                                       "splits": used,
                                       "kernel": _kernel_text(cfg, record),
                                       "ms": t_ms,
                                       "kv_tb_s": kv_bytes / (t_ms * 1e-3) / 1e12,
                                       "max_rel_err": err})
                        print(f"  {cfg_label}: {t_ms:.3f} ms, "
                              f"{tuning[-1]['kv_tb_s']:.2f} TB/s", flush=True)
            del built, cache, tables
            torch.cuda.empty_cache()
    _write(args, props, sms, rows, tuning, notes, failures, time.perf_counter() - started)
    if failures:
        print("mla_decode: wrong results:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    return 0


def _kernel_text(cfg: dict, record: Any) -> str:
    """The kernel that ran the last call, with the CUDA build's stages and CTAs per SM."""
    from kernelbay_attn_flashmla.triton_mla import last_kernel

    used = last_kernel() or "-"
    if used == "cuda":
        from dataclasses import asdict

        from kernelbay_attn_flashmla.cuda_mla import build_for, call_build

        # what mla_decode builds for this call
        build = asdict(build_for(record, **call_build(PAGE, cfg.get("cuda_build"), record.kind)))
        used += (f" s{build['stages']} b{build['min_blocks']}"
                 f"{' qs' if build['query_in_shared'] else ''} t{build['tile']}"
                 f"{' ss' if build['split_sum'] else ''}{' tma' if build['bulk_copy'] else ''}"
                 f"{' lazy' if build['lazy_max'] else ''}")
    return used


def _tune_launch(tune: dict, l2_ahead: int) -> dict:
    """A sweep entry with the unnamed options at the kernel's defaults."""
    # the swept options are the Triton kernel's, so entries run it unless they name another
    # (the split sweep passes the run's own)
    kernel = tune.get("kernel", "triton")
    base = dict(block_n=None, num_warps=None, chunked=None, grouped=False, reg_prefetch=True,
                num_stages=2, l2_ahead=l2_ahead if kernel == "triton" else None,
                f16_dot=False, kernel="triton")
    return dict(base, **{k: v for k, v in tune.items() if v is not None or k not in base})


def _measure(mla_decode, record, cache, meta, query, scale: float, launch: dict,
             args) -> tuple[float, float]:
    """Check one launch configuration against the reference, then time it: (max relative
    error, ms)."""
    out, _ = mla_decode(query, cache, record, PAGE, meta, scale, **launch)
    err = _check(record, cache, meta, query, out, scale)
    ms = _time(functools.partial(mla_decode, query, cache, record, PAGE, meta, scale,
                                 **launch), args.rep, args.eager, args.settle_s)
    return err, ms


def _write(args, props, sms: int, rows: list[dict], tuning: list[dict], notes: list[str],
           failures: list[str], seconds: float) -> None:
    """results.json and results.md under ``--out``."""
    import triton
    base = {(r["batch"], r["context"], r["heads"]): r["ms"] for r in rows if r["kind"] == "bf16"}
    for r in rows:
        b = base.get((r["batch"], r["context"], r["heads"]))
        r["speedup_vs_bf16"] = (b / r["ms"]) if b else None
    best: dict[tuple, dict] = {}
    for r in tuning:
        key = (r["kind"], r["batch"], r["context"], r["heads"])
        if r["max_rel_err"] <= ATOL and (key not in best or r["ms"] < best[key]["ms"]):
            best[key] = r
    for r in tuning:
        r["best"] = best.get((r["kind"], r["batch"], r["context"], r["heads"])) is r
        b = base.get((r["batch"], r["context"], r["heads"]))
        bf = best.get(("bf16", r["batch"], r["context"], r["heads"]))
        r["speedup_vs_best_bf16"] = (bf["ms"] / r["ms"]) if bf else None
        r["speedup_vs_bf16"] = (b / r["ms"]) if b else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": props.name, "sms": sms, "torch": torch.__version__,
            "timing": ("eager do_bench" if args.eager else "CUDA graph replay")
            + f", each after {args.settle_s} s idle",
            "block_n": args.block_n, "warps": args.warps,
            "stages": args.stages, "grouped": args.grouped, "l2_ahead": args.l2_ahead,
            "triton": triton.__version__, "page_size": PAGE, "seconds": seconds,
            "notes": notes, "failures": failures}
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows,
                                                  "tuning": tuning}, indent=2))
    timing = ("eager launches (host work included)" if args.eager else
              "CUDA-graph replays (kernel time only; metadata and tables made before timing)")
    lines = [f"# MLA decode (mla-triton: Triton and CUDA kernels), {props.name}", "",
             f"One decode step, page {PAGE}, random page tables, timed as {timing}, each "
             f"after {args.settle_s} s of idle GPU; KV TB/s "
             "counts each context record once; x bf16 = bf16-record time / this time (same "
             "run).", "",
             "| kind | dims | B/token | batch | context | heads | kernel | splits | ms | "
             "KV TB/s | TFLOP/s | x bf16 |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in sorted(rows, key=lambda r: (r["heads"], r["context"], r["batch"],
                                         KINDS.index(r["kind"]))):
        ratio = f"{r['speedup_vs_bf16']:.2f}" if r["speedup_vs_bf16"] else "-"
        lines.append(f"| {r['kind']} | {r['dims']} | {r['bytes_per_token']} | {r['batch']} | "
                     f"{r['context']} | {r['heads']} | {r['kernel']} | {r['splits']} | "
                     f"{r['ms']:.3f} | "
                     f"{r['kv_tb_s']:.2f} | {r['tflops']:.1f} | {ratio} |")
    if tuning:
        lines += ["", "Launch-configuration sweep (the table above uses the kernel's "
                  "defaults; * best of its case; x best bf16 = the fastest bf16 "
                  "configuration's time / this time):", "",
                  "| kind | batch | context | heads | kernel | f16 dots | chunked | block_n | "
                  "warps | stages | prefetch | L2 ahead | splits | ms | KV TB/s | x bf16 | "
                  "x best bf16 |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | "
                  "--- | --- | --- | --- | --- |"]
        for r in tuning:
            x = f"{r['speedup_vs_bf16']:.2f}" if r["speedup_vs_bf16"] else "-"
            xb = f"{r['speedup_vs_best_bf16']:.2f}" if r["speedup_vs_best_bf16"] else "-"
            lines.append(f"| {r['kind']} | {r['batch']} | {r['context']} | {r['heads']} | "
                         f"{r['kernel']} | {r['f16_dot']} | {r['chunked']} | {r['block_n']} | {r['warps']} | "
                         f"{r['stages']} | "
                         f"{r['reg_prefetch']} | {r['l2_ahead']} | {r['splits']} | "
                         f"{r['ms']:.3f}{' *' if r['best'] else ''} | {r['kv_tb_s']:.2f} | "
                         f"{x} | {xb} |")
    lines += [""] + [f"- {n}" for n in notes] + [f"- FAILED {f}" for f in failures]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / 'results.md'} in {seconds:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
