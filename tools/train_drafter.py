"""Distil a DFlash2 drafter for the bundled demo model from the target's own hidden states
and outputs (the dflash2 proposer's bundled ``demo`` drafter).

    python tools/train_drafter.py --out DIR --device cuda --corpus /tmp/stdlib   # H200: ~3 min
    python tools/train_drafter.py --out DIR --device cpu --steps 3 --prompts 4 --gen 16 \\
        --eval-prompts 2 --eval-tokens 16                                       # smoke run

1. Data: ``--prompts`` windows of ``--prompt-len`` bytes at random offsets of the training
   corpus (the demo model's: the CPython standard library minus the held-out modules, read as
   tools/train_demo.py reads it), continued by the target for ``--gen`` tokens -- two thirds
   greedily, one third sampled at temperature 0.8 -- so the drafter learns the text it will
   be asked to draft. One target forward over every sequence then gives the hidden states at the
   drafter's layers and the target's logits at every position.
2. Training: random anchors in the generated part of those sequences. The drafter sees the states of the
   ``context_window`` positions before the anchor and the anchor token, and drafts the next
   k tokens; the loss per slot is cross-entropy with the token the target produced plus the KL
   divergence from the target's distribution there (slot weights decay with depth), and the
   candidate selector is trained as a linear-chain CRF over each block's top-c lattice (log Z
   minus the score of the target's path, when that path lies in the lattice).
3. Evaluation: the mean accepted length tau (tokens per target forward, bonus included) at
   k = 8 on held-out prompts with ``kernelbay.LLM``, greedy and at temperature 0.8; written
   with the weights (``config.json``, ``model.safetensors`` in bf16), ``training.json`` and the
   model card ``README.md`` into ``--out``.

Deterministic given ``--seed`` on one machine (deterministic algorithms, generators seeded).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "core", "src"))
sys.path.insert(0, os.path.join(HERE, "..", "plugins", "spec_dflash2", "src"))

from kernelbay.demo import BOS_ID, VOCAB_SIZE, demo_path, heldout_windows  # noqa: E402
from kernelbay_spec_dflash2.config import DFlash2Config  # noqa: E402
from kernelbay_spec_dflash2.drafter import DFlash2Drafter, save_drafter  # noqa: E402
from kernelbay_spec_dflash2.modules import path_scores  # noqa: E402
from train_demo import corpus_files, load_corpus  # noqa: E402

#: The shipped drafter's shape: ~0.97 M parameters, under 2 MB in bf16.
DRAFTER = dict(target_model_type="deepseek_v3", target_hidden_size=256, vocab_size=VOCAB_SIZE,
               target_layer_ids=(1, 3, 4), hidden_size=192, num_layers=2, num_heads=4,
               intermediate_size=320, block_size=8, num_candidates=16, pair_rank=16,
               conv_groups=8, context_window=128)
SAMPLE_TEMPERATURE = 0.8


def load_target(device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The demo model in transformers (eager attention and experts: deterministic)."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(demo_path(), dtype=dtype,
                                                     attn_implementation="eager",
                                                     experts_implementation="eager")
    except (TypeError, ValueError):  # a transformers without selectable expert kernels
        model = AutoModelForCausalLM.from_pretrained(demo_path(), dtype=dtype,
                                                     attn_implementation="eager")
    return model.to(device).eval()


@torch.no_grad()
def continue_prompts(target: torch.nn.Module, prompts: torch.Tensor, steps: int,
                     sampled: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """``prompts`` [N, P] continued by ``steps`` target tokens each (with its KV cache):
    greedy rows, and rows of ``sampled`` drawn at SAMPLE_TEMPERATURE with Gumbel noise."""
    out = target(input_ids=prompts, use_cache=True)
    past, logits = out.past_key_values, out.logits[:, -1].float()
    tokens = [prompts]
    for _ in range(steps):
        u = torch.rand(logits.shape, generator=gen, device=gen.device).to(logits.device)
        noise = -torch.log(-torch.log(u.clamp(1e-20, 1 - 1e-7)))
        pick = torch.where(sampled, (logits / SAMPLE_TEMPERATURE + noise).argmax(-1),
                           logits.argmax(-1))
        tokens.append(pick[:, None])
        out = target(input_ids=pick[:, None], past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1].float()
    return torch.cat(tokens, dim=1)


@torch.no_grad()
def target_features(target: torch.nn.Module, seqs: torch.Tensor, layers: tuple[int, ...],
                    chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states at ``layers`` [N, T, len(layers) * H] (bf16) and logits [N, T, V] (bf16)."""
    feats, logits = [], []
    for start in range(0, seqs.shape[0], chunk):
        out = target(input_ids=seqs[start:start + chunk], output_hidden_states=True)
        feats.append(torch.cat([out.hidden_states[i] for i in layers], dim=-1).bfloat16())
        logits.append(out.logits.bfloat16())
    return torch.cat(feats), torch.cat(logits)


def crf_loss(drafter: DFlash2Drafter, logits: torch.Tensor, anchor: torch.Tensor,
             gold: torch.Tensor) -> torch.Tensor:
    """Mean over blocks whose gold path lies in the top-c lattice of log Z - S(gold)."""
    ids, unigram, first, between, log_z = drafter.selector.log_partition(logits, anchor)
    hit = ids == gold[..., None]                                       # [B, k, c]
    inside = hit.any(-1).all(-1)
    choice = hit.float().argmax(-1)
    score = path_scores(unigram, first, between, choice)
    return ((log_z - score) * inside).sum() / inside.sum().clamp(min=1)


def fit(drafter: DFlash2Drafter, opt: torch.optim.Optimizer, tokens: torch.Tensor,
        feats: torch.Tensor, target_logits: torch.Tensor, args: argparse.Namespace,
        gen: torch.Generator) -> int:
    """The training loop (see the module docstring); returns the number of steps run."""
    device = tokens.device
    config = drafter.config
    k, window = config.block_size, config.context_window
    length = tokens.shape[1]
    lowest = min(args.prompt_len + 1, length - k - 2)  # anchors in the generated text
    slot_weight = torch.tensor([0.85 ** t for t in range(k)], device=device)
    warmup = max(1, args.steps // 20)
    started = time.perf_counter()
    drafter.train()
    steps = args.steps
    for step in range(args.steps):
        if args.time_budget and time.perf_counter() - started > args.time_budget:
            steps = step
            print(f"time budget of {args.time_budget}s reached after {step} steps", flush=True)
            break
        lr = args.lr * min(1.0, (step + 1) / warmup) * (
            0.1 + 0.45 * (1 + math.cos(math.pi * step / max(1, args.steps))))
        for group in opt.param_groups:
            group["lr"] = lr
        row = torch.randint(0, tokens.shape[0], (args.batch,), generator=gen).to(device)
        anchor_at = torch.randint(lowest, length - k - 1, (args.batch,),
                                  generator=gen).to(device)
        ctx_at = anchor_at[:, None] - window + torch.arange(window, device=device)[None]
        mask = ctx_at >= 0
        context = feats[row[:, None], ctx_at.clamp(min=0)].float()
        slots = anchor_at[:, None] + torch.arange(k, device=device)[None]
        gold = tokens[row[:, None], slots + 1]                          # [B, k]
        soft = target_logits[row[:, None], slots].float()               # [B, k, V]
        anchor = tokens[row, anchor_at]
        logits = drafter(anchor, context, mask)
        logp = torch.log_softmax(logits.float(), dim=-1)
        ce = F.nll_loss(logp.reshape(-1, VOCAB_SIZE), gold.reshape(-1),
                        reduction="none").view(-1, k)
        kl = (torch.softmax(soft, -1) * (torch.log_softmax(soft, -1) - logp)).sum(-1)
        slot_loss = ((ce + kl) * slot_weight).sum(-1).mean() / slot_weight.sum()
        loss = slot_loss + 0.1 * crf_loss(drafter, logits, anchor, gold) / k
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        if step % 200 == 0 or step == args.steps - 1:
            accuracy = (logits.argmax(-1) == gold).float().mean(0)
            print(f"step {step:5d}  loss {loss.item():.4f}  slot acc "
                  f"{' '.join(f'{a:.2f}' for a in accuracy.tolist())}  "
                  f"{time.perf_counter() - started:.0f}s", flush=True)
    return steps


def train(args: argparse.Namespace, device: torch.device) -> tuple[DFlash2Drafter, dict]:
    config = DFlash2Config(**{**DRAFTER, "context_window": args.context_window})  # type: ignore[arg-type]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = load_target(device, dtype)
    data = load_corpus(args.corpus)
    gen = torch.Generator().manual_seed(args.seed)
    dev_gen = torch.Generator(device=device).manual_seed(args.seed)
    started = time.perf_counter()
    seqs = []
    for start in range(0, args.prompts, args.gen_batch):
        n = min(args.gen_batch, args.prompts - start)
        offsets = torch.randint(0, len(data) - args.prompt_len, (n,), generator=gen).tolist()
        prompts = torch.stack([torch.cat([torch.tensor([BOS_ID]), data[o:o + args.prompt_len]])
                               for o in offsets]).to(device)
        sampled = (torch.arange(start, start + n, device=device) % 3) == 2
        seqs.append(continue_prompts(target, prompts, args.gen, sampled, dev_gen))
    tokens = torch.cat(seqs)                                           # [N, T]
    feats, target_logits = target_features(target, tokens, config.target_layer_ids,
                                           args.gen_batch)
    del target
    gen_seconds = time.perf_counter() - started
    print(f"data: {tokens.shape[0]} sequences x {tokens.shape[1]} tokens "
          f"({gen_seconds:.0f}s)", flush=True)

    torch.manual_seed(args.seed)
    drafter = DFlash2Drafter(config).to(device)
    with torch.no_grad():  # the pair term starts neutral: Viterbi = per-slot argmax
        drafter.selector.pair_u.weight.mul_(0.01)
        drafter.selector.pair_v.weight.mul_(0.01)
    params = sum(p.numel() for p in drafter.parameters())
    print(f"drafter: {params / 1e6:.3f} M parameters", flush=True)
    opt = torch.optim.AdamW(drafter.parameters(), lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=0.01)
    # The math attention kernel: its backward is deterministic (the fused ones' are not).
    from torch.nn.attention import SDPBackend, sdpa_kernel

    started = time.perf_counter()
    with sdpa_kernel([SDPBackend.MATH]):
        steps = fit(drafter, opt, tokens, feats, target_logits, args, gen)
    drafter.eval()
    stats = {"drafter_parameters": params, "steps": steps, "batch": args.batch,
             "lr": args.lr, "seed": args.seed, "prompts": args.prompts,
             "prompt_len": args.prompt_len, "gen": args.gen,
             "data_seconds": round(gen_seconds, 1),
             "train_seconds": round(time.perf_counter() - started, 1),
             "device": str(device), "device_name": (torch.cuda.get_device_name()
                                                    if device.type == "cuda" else "cpu"),
             "torch": torch.__version__, "corpus_files": len(corpus_files(args.corpus)),
             "corpus_bytes": len(data)}
    return drafter, stats


def heldout_prompts(count: int) -> list[str]:
    """``count`` windows of the held-out sample (never trained on), 64 to 192 bytes."""
    return heldout_windows(count, seed=4321)


def evaluate(folder: str, device: torch.device, prompts: int, tokens: int) -> dict:
    """tau at k = 8 on held-out prompts, greedy and at temperature 0.8, with kernelbay.LLM."""
    from kernelbay.engine import LLM, SamplingParams, SpeculativeConfig
    from kernelbay_spec_dflash2.registry import dflash2_registry

    registry = dflash2_registry()
    llm = LLM(demo_path(), device=device, registry=registry, max_num_seqs=max(prompts, 1),
              speculative=SpeculativeConfig("dflash2", 8, drafter=folder))
    ids = [llm.encode(p) for p in heldout_prompts(prompts)]
    result = {}
    for name, temperature in (("greedy", 0.0), ("t0.8", SAMPLE_TEMPERATURE)):
        params = [SamplingParams(max_tokens=tokens, temperature=temperature, seed=i,
                                 ignore_eos=True) for i in range(len(ids))]
        outs = llm.generate(ids, params)
        result[f"tau_{name}"] = round(sum(len(o.token_ids) for o in outs)
                                      / sum(o.steps for o in outs), 3)
    result.update(eval_prompts=prompts, eval_tokens=tokens, eval_k=8,
                  eval_dtype=str(llm.dtype).removeprefix("torch."))
    return result


CARD = """# DFlash2 drafter for the kernelbay demo model

Trained by `tools/train_drafter.py`; read by the `dflash2` proposer when the target is the
demo model (`kernelbay run --speculative dflash2 --num-speculative-tokens 8`).

| | |
| --- | --- |
| target | the kernelbay demo model (byte-level DeepSeek-V3 architecture, 4 layers, hidden 256) |
| drafter | {layers} sublayers, width {hidden}, {heads} heads, MLP {inter}; reads target layers {ids} over the latest {window} positions; block k = {k}, selector top-{c}, pair rank {rank} |
| parameters | {params:,} (`model.safetensors` {size:,} bytes, bf16) |
| data | {prompts} windows of {prompt_len} bytes of the demo model's training corpus ({files} files of the CPython standard library, held-out modules excluded), each continued by the target for {gen} tokens (two thirds greedy, one third at temperature 0.8); target hidden states and logits from one forward over each |
| training | {steps} steps of {batch} blocks; loss per slot = CE with the target's token + KL from the target's distribution, plus a CRF loss for the candidate selector; AdamW lr {lr}; seed {seed}; {device_name}, {train_seconds} s (+ {data_seconds} s making the data) |
| **acceptance** | **tau = {tau_greedy} greedy, {tau_t} at temperature 0.8** (mean tokens per target forward incl. the bonus token, k = 8, {eval_prompts} held-out prompts x {eval_tokens} tokens, {eval_dtype}) |

Speculative output is identical to plain decoding whatever the drafter; these weights only
decide how many tokens each target forward yields.
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder to write the drafter into")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--batch", type=int, default=1024, help="blocks per step")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--prompts", type=int, default=8192, help="sequences of training data")
    parser.add_argument("--prompt-len", type=int, default=96)
    parser.add_argument("--gen", type=int, default=192, help="target tokens per sequence")
    parser.add_argument("--gen-batch", type=int, default=2048)
    parser.add_argument("--eval-prompts", type=int, default=32)
    parser.add_argument("--eval-tokens", type=int, default=128)
    parser.add_argument("--context-window", type=int, default=DRAFTER["context_window"],
                        help="target positions the drafter attends to")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="stop training after this many seconds (a safety net; the "
                        "steps run are recorded)")
    parser.add_argument("--corpus", help="standard-library folder (default: this "
                        "interpreter's)")
    args = parser.parse_args()

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    device = torch.device(args.device)
    drafter, stats = train(args, device)
    save_drafter(drafter.float().cpu(), args.out, dtype=torch.bfloat16)
    finish(args.out, stats, device, args.eval_prompts, args.eval_tokens)
    return 0


def finish(out: str, stats: dict, device: torch.device, prompts: int, tokens: int) -> None:
    """Measure tau of the drafter saved in ``out`` and write ``training.json`` and the card
    (``stats``: what training recorded)."""
    from kernelbay_spec_dflash2.config import read_drafter_config

    stats.update(evaluate(out, device, prompts, tokens))
    size = os.path.getsize(os.path.join(out, "model.safetensors"))
    stats["safetensors_bytes"] = size
    with open(os.path.join(out, "training.json"), "w", encoding="utf-8") as f:
        json.dump(stats, f, indent=2)
    c = read_drafter_config(out)
    with open(os.path.join(out, "README.md"), "w", encoding="utf-8") as f:
        f.write(CARD.format(layers=c.num_layers, hidden=c.hidden_size, heads=c.num_heads,
                            inter=c.intermediate_size, ids=list(c.target_layer_ids),
                            window=c.context_window, k=c.block_size, c=c.num_candidates,
                            rank=c.pair_rank, params=stats["drafter_parameters"], size=size,
                            files=stats["corpus_files"], tau_t=stats["tau_t0.8"], **{
                                key: stats[key] for key in (
                                    "prompts", "prompt_len", "gen", "steps", "batch", "lr",
                                    "seed", "device_name", "train_seconds", "data_seconds",
                                    "tau_greedy", "eval_prompts", "eval_tokens",
                                    "eval_dtype")}))
    print(json.dumps(stats), flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
