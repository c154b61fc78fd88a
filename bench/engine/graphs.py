"""Decode steps from CUDA graphs against eager steps, on the bundled demo (DeepSeek-V3
architecture: MLA attention, routed experts), measured in the same run.

For each variant (KV record kind; weights as shipped or quantized by a writer) and batch
size: decode tokens/s of ``LLM.generate`` with graphs on and with ``cuda_graphs=False``
(the first tokens of each run, which capture the graphs, are excluded: the timed generate
follows an untimed one of the same shapes), whether both gave the same greedy tokens, and
which batch sizes failed to capture. A wrong result (different tokens, a failed capture) fails
the run after the results are written. CUDA only.

    python bench/engine/graphs.py [--kinds bf16,mxfp8] [--quantize modelopt-nvfp4] \\
        [--batches 1,8] [--new-tokens 64] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from report import write_results

PROMPTS = ["def main(", "import os\n", "class A:", "x = 1", "# a", "for i in", "if x:",
           "return "]


def decode_rate(llm: Any, prompts: list[str], new: int) -> tuple[list[list[int]], float]:
    """(greedy tokens, decode tokens/s after the first token) of one generate call, after an
    untimed call of the same shapes (which builds kernels and captures graphs)."""
    from kernelbay.engine import SamplingParams

    params = SamplingParams(max_tokens=new, ignore_eos=True, temperature=0)
    llm.generate(prompts, params)
    first = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0)
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(prompts, first)
    torch.cuda.synchronize()
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    out = llm.generate(prompts, params)
    torch.cuda.synchronize()
    decode = max(time.perf_counter() - start - prefill, 1e-9)
    return [o.token_ids for o in out], len(prompts) * (new - 1) / decode


def run_variant(path: str, label: str, kind: str, batches: list[int], new: int
                ) -> tuple[list[dict[str, Any]], list[str]]:
    from kernelbay.engine import LLM

    graphed = LLM(path, kv_cache=kind, device="cuda")
    eager = LLM(path, kv_cache=kind, device="cuda", cuda_graphs=False)
    rows, failures = [], []
    for batch in batches:
        prompts = PROMPTS[:batch]
        got, graph_rate = decode_rate(graphed, prompts, new)
        want, eager_rate = decode_rate(eager, prompts, new)
        rows.append(dict(weights=label, kv_cache=kind, batch=batch, new_tokens=new,
                         graphs_tok_s=graph_rate, eager_tok_s=eager_rate,
                         ratio=graph_rate / eager_rate, same_tokens=got == want))
        if got != want:
            failures.append(f"{label} {kind} batch {batch}: graph tokens differ from eager")
    graphs = graphed.runner.graphs
    if graphs is None or graphs.failed:
        failures.append(f"{label} {kind}: captures failed: "
                        f"{None if graphs is None else graphs.failed}")
    for row in rows:
        row["attention"] = graphed.plan.attention.chosen
        row["linears"] = sorted({d.chosen for d in graphed.plan.linears})
        row["replays"] = 0 if graphs is None else graphs.replays
    return rows, failures


def markdown(result: dict[str, Any]) -> str:
    lines = [f"# Decode steps: CUDA graphs vs eager, demo model ({result['device']})", "",
             f"{result['when']}, torch {result['torch']}; greedy, {result['new_tokens']} new "
             "tokens, decode tokens/s after the first token, each after an untimed run of the "
             "same shapes; same = the two runs gave the same tokens.", "",
             "| weights | KV records | batch | graphs tok/s | eager tok/s | x | same | "
             "attention | linear methods |",
             "| --- | --- | ---: | ---: | ---: | ---: | --- | --- | --- |"]
    for r in result["rows"]:
        lines.append(f"| {r['weights']} | {r['kv_cache']} | {r['batch']} | "
                     f"{r['graphs_tok_s']:.0f} | {r['eager_tok_s']:.0f} | {r['ratio']:.2f} | "
                     f"{'yes' if r['same_tokens'] else 'NO'} | {r['attention']} | "
                     f"{', '.join(r['linears'])} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", default="bf16,mxfp8")
    parser.add_argument("--quantize", default="modelopt-nvfp4",
                        help="also a copy written in this format ('' for none)")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    from kernelbay.demo import demo_path
    from kernelbay.plugins import get_registry
    from kernelbay.quantize import quantize_checkpoint

    batches = [int(b) for b in args.batches.split(",")]
    if max(batches) > len(PROMPTS):
        parser.error(f"--batches: at most {len(PROMPTS)}, got {max(batches)}")
    variants = [(demo_path(), "bf16 (as shipped)", kind) for kind in args.kinds.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        if args.quantize:
            path = quantize_checkpoint(demo_path(), os.path.join(tmp, "q"), args.quantize,
                                       registry=get_registry())
            variants.append((path, args.quantize, "bf16"))
        rows, failures = [], []
        for path, label, kind in variants:
            got, bad = run_variant(path, label, kind, batches, args.new_tokens)
            rows += got
            failures += bad
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                  python=platform.python_version(),
                  when=time.strftime("%Y-%m-%dT%H:%M:%S%z"), new_tokens=args.new_tokens,
                  rows=rows)
    print(markdown(result))
    return write_results(args.out, result, markdown(result), failures)


if __name__ == "__main__":
    raise SystemExit(main())
