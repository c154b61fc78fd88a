"""Two-GPU engine check: with batch-invariant mode on, TP=2 over NCCL generates the same
greedy tokens as TP=1 on the demo model, per dtype (default: bf16 and fp32). Rank 0 writes
engine_tp2.json and engine_tp2.md to --out; exits non-zero when a dtype named in
--require-identical has a mismatch (after writing the result).

TP=2 sums a row-parallel layer's K halves on separate ranks and adds them in the
all-reduce, TP=1 sums all of K in one walk: the orders differ, so bf16 logits can differ in
the last bit and flip near-tied greedy choices; fp32 leaves far less room for that, hence
fp32 is the dtype required to match by default and bf16 is reported.
``KERNELBAY_FORCE_COLLECTIVE=tp-symm-mem-two-shot`` runs the symmetric-memory all-reduce.

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
    parser.add_argument("--dtypes", "--dtype", default="bfloat16,float32",
                        help="comma-separated model dtypes to compare (default: %(default)s)")
    parser.add_argument("--require-identical", default="float32",
                        help="dtypes whose TP=2 tokens must equal TP=1's for exit status 0 "
                             "(comma separated; empty: report only)")
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
    dtypes = [d for d in args.dtypes.split(",") if d]
    required = {d for d in args.require_identical.split(",") if d}
    runs = []
    status = 0
    for dtype in dtypes:
        tp2 = LLM(demo_path(), dtype=dtype, device=f"cuda:{local}", tensor_parallel_size=2,
                  registry=Registry.discover(policy))
        text = heldout_text()
        prompts = [tp2.encode(text[s:s + 150]) for s in range(0, 3000, 375)]
        got = [o.token_ids for o in tp2.generate(prompts, params)]
        plan = tp2.plan
        if dist.get_rank() == 0:
            tp1 = LLM(demo_path(), dtype=dtype, device="cuda:0",
                      registry=Registry.discover(policy))
            expected = [o.token_ids for o in tp1.generate(prompts, params)]
            same = [a == b for a, b in zip(got, expected, strict=True)]
            first = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y),
                          None) for a, b in zip(got, expected, strict=True)]
            runs.append({"dtype": dtype, "prompts": len(prompts),
                         "max_tokens": args.max_tokens, "identical": all(same),
                         "required": dtype in required, "per_prompt_identical": same,
                         "first_difference": first,
                         "collective": plan.collective.chosen if plan.collective else None,
                         "gemm_collective": (plan.gemm_collective.chosen
                                             if plan.gemm_collective else None),
                         "gather_collective": (plan.gather_collective.chosen
                                               if plan.gather_collective else None),
                         "attention": plan.attention.chosen,
                         "linears": sorted({d.chosen for d in plan.linears})})
            if dtype in required and not all(same):
                status = 1
            del tp1
        del tp2
        dist.barrier()
    if dist.get_rank() == 0:
        result = {"device": torch.cuda.get_device_name(), "runs": runs}
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "engine_tp2.json"), "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
        md = ["# TP=2 (NCCL) vs TP=1, batch-invariant mode, demo model", "",
              f"- device: 2 x {result['device']}"]
        for r in runs:
            n_same = sum(r["per_prompt_identical"])
            md += ["", f"## {r['dtype']}" + (" (required to match)" if r["required"] else
                                              " (reported)"), "",
                   f"- collective: {r['collective']}; gemm + all-reduce: "
                   f"{r['gemm_collective']}; all-gather: {r.get('gather_collective')}; "
                   f"attention: {r['attention']}; linears: "
                   f"{', '.join(r['linears'])}",
                   f"- {n_same}/{len(r['per_prompt_identical'])} prompts x "
                   f"{r['max_tokens']} greedy tokens identical",
                   f"- first differing position per prompt (None = identical): "
                   f"{r['first_difference']}"]
        with open(os.path.join(args.out, "engine_tp2.md"), "w", encoding="utf-8") as f:
            f.write("\n".join(md) + "\n")
        print("\n".join(md))
    dist.barrier()
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
