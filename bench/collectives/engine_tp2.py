"""Two-GPU engine check: with batch-invariant mode on, TP=2 over NCCL generates the same
greedy tokens as TP=1 on the demo model (bf16). Rank 0 writes engine_tp2.json and
engine_tp2.md to --out; exits non-zero on a mismatch (after writing the result).

    torchrun --nproc-per-node 2 bench/collectives/engine_tp2.py --out DIR   # about 1 minute
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    import torch
    import torch.distributed as dist
    from kernelbay import Policy, Registry
    from kernelbay.demo import demo_path, heldout_text
    from kernelbay.engine import LLM, SamplingParams

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    policy = Policy.from_env().updated(batch_invariant=True)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    tp2 = LLM(demo_path(), dtype=args.dtype, device=f"cuda:{local}", tensor_parallel_size=2,
              registry=Registry.discover(policy))
    text = heldout_text()
    prompts = [tp2.encode(text[s:s + 150]) for s in range(0, 3000, 375)]
    got = [o.token_ids for o in tp2.generate(prompts, params)]
    plan = tp2.plan
    status = 0
    if dist.get_rank() == 0:
        tp1 = LLM(demo_path(), dtype=args.dtype, device="cuda:0", registry=Registry.discover(policy))
        expected = [o.token_ids for o in tp1.generate(prompts, params)]
        same = [a == b for a, b in zip(got, expected, strict=True)]
        first = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
                 for a, b in zip(got, expected, strict=True)]
        result = {"device": torch.cuda.get_device_name(), "dtype": args.dtype,
                  "prompts": len(prompts), "max_tokens": args.max_tokens,
                  "identical": all(same), "per_prompt_identical": same,
                  "first_difference": first,
                  "collective": plan.collective.chosen if plan.collective else None,
                  "gemm_collective": (plan.gemm_collective.chosen if plan.gemm_collective
                                      else None),
                  "attention": plan.attention.chosen,
                  "linears": sorted({d.chosen for d in plan.linears})}
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "engine_tp2.json"), "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
        md = ["# TP=2 (NCCL) vs TP=1, batch-invariant mode, demo model", "",
              f"- device: 2 x {result['device']}, dtype {args.dtype}",
              f"- collective: {result['collective']}; gemm + all-reduce: "
              f"{result['gemm_collective']}; attention: {result['attention']}; linears: "
              f"{', '.join(result['linears'])}",
              f"- {sum(same)}/{len(same)} prompts x {args.max_tokens} greedy tokens identical",
              f"- first differing position per prompt (None = identical): {first}"]
        with open(os.path.join(args.out, "engine_tp2.md"), "w", encoding="utf-8") as f:
            f.write("\n".join(md) + "\n")
        print("\n".join(md))
        status = 0 if all(same) else 1
    dist.barrier()
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
