"""Engine throughput: decode and prefill tokens/s of Llama-shaped models, against
transformers' ``generate`` on the same checkpoint, measured in the same run.

For each model size and batch size: prefill tokens/s (prompt tokens / time to first token)
and decode tokens/s (generated tokens after the first / remaining time), for kernelbay's
``LLM.generate`` and for transformers (``generate`` with its default KV cache, greedy, EOS
off). Writes results.json and results.md (``--out``). Random weights: speed does not depend
on them.

    python bench/engine/run.py [--sizes small,medium] [--batches 1,8] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import tempfile
import time
from functools import partial
from typing import Any

import torch

SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=4),
    "small": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4),
    "medium": dict(hidden_size=1024, intermediate_size=2752, num_hidden_layers=12,
                   num_attention_heads=16, num_key_value_heads=8),
    "large": dict(hidden_size=2048, intermediate_size=5504, num_hidden_layers=16,
                  num_attention_heads=16, num_key_value_heads=8),
}
VOCAB = 32000


def make_checkpoint(path: str, size: str, dtype: torch.dtype) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, max_position_embeddings=4096, **SIZES[size])
    LlamaForCausalLM(config).to(dtype).save_pretrained(path)
    return path


def _prompts(batch: int, length: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(batch)
    return [torch.randint(3, VOCAB, (length,), generator=gen).tolist() for _ in range(batch)]


def time_kernelbay(llm: Any, prompts: list[list[int]], new: int) -> tuple[float, float]:
    from kernelbay.engine import SamplingParams

    first = llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True))
    del first
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True))
    ttft = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=new, ignore_eos=True))
    total = time.perf_counter() - start
    return ttft, total


def time_transformers(model: Any, prompts: list[list[int]], new: int) -> tuple[float, float]:
    ids = torch.tensor(prompts)

    def run(n: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                           min_new_tokens=n, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
        return time.perf_counter() - start

    run(1)
    return run(1), run(new)


def measure(fn: Any, repeats: int) -> tuple[float, float]:
    runs = [fn() for _ in range(repeats)]
    return (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="small,medium")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    parser.add_argument("--no-reference", action="store_true",
                        help="time kernelbay only (an A/B between kernelbay versions); the "
                             "transformers columns are left empty")
    parser.add_argument("--core-only", action="store_true",
                        help="only the core's reference backends (ignore installed plugins)")
    args = parser.parse_args()
    from kernelbay import Policy
    from kernelbay.engine import LLM
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes.split(","):
            path = make_checkpoint(os.path.join(tmp, size), size, dtype)
            policy = Policy(plugins=frozenset()) if args.core_only else Policy.from_env()
            llm = LLM(path, device=args.device, dtype=args.dtype, max_num_seqs=16,
                      progress=False, policy=policy)
            linear = sorted({d.chosen for d in llm.plan.linears})
            ref = None if args.no_reference else AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype).to(args.device).eval()
            for batch in (int(b) for b in args.batches.split(",")):
                prompts = _prompts(batch, args.prompt_len)
                n = args.new_tokens
                ours = measure(partial(time_kernelbay, llm, prompts, n), args.repeats)
                theirs = (math.inf, math.inf) if ref is None else measure(
                    partial(time_transformers, ref, prompts, n), args.repeats)
                row: dict[str, Any] = {"size": size, "batch": batch,
                                       "prompt_len": args.prompt_len, "new_tokens": n,
                                       "linear_backends": linear,
                                       "attention_backend": llm.plan.attention.chosen}
                for name, (ttft, total) in (("kernelbay", ours), ("transformers", theirs)):
                    row[f"{name}_prefill_tok_s"] = (batch * args.prompt_len / ttft
                                                    if math.isfinite(ttft) else math.nan)
                    row[f"{name}_decode_tok_s"] = (batch * (n - 1) / max(total - ttft, 1e-9)
                                                   if math.isfinite(total) else math.nan)
                row["decode_ratio"] = row["kernelbay_decode_tok_s"] / row[
                    "transformers_decode_tok_s"]
                row["prefill_ratio"] = row["kernelbay_prefill_tok_s"] / row[
                    "transformers_prefill_tok_s"]
                rows.append(row)
                print(json.dumps(row), flush=True)
    device_name = (torch.cuda.get_device_name() if args.device.startswith("cuda")
                   else platform.processor() or platform.machine())
    result = {"bench": "engine", "device": device_name, "dtype": args.dtype,
              "threads": torch.get_num_threads(), "torch": torch.__version__, "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    lines = [f"engine on {device_name}, {args.dtype}, {torch.get_num_threads()} threads, prompt "
             f"{args.prompt_len}, {args.new_tokens} new tokens", "",
             "| size | batch | decode tok/s (kernelbay) | decode tok/s (transformers) | x | "
             "prefill tok/s (kernelbay) | prefill tok/s (transformers) | x | linear backends |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['size']} | {r['batch']} | {r['kernelbay_decode_tok_s']:.1f} | "
              f"{r['transformers_decode_tok_s']:.1f} | {r['decode_ratio']:.2f} | "
              f"{r['kernelbay_prefill_tok_s']:.0f} | {r['transformers_prefill_tok_s']:.0f} | "
              f"{r['prefill_ratio']:.2f} | {', '.join(r['linear_backends'])} |" for r in rows]
    with open(os.path.join(args.out, "results.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
