"""Train the bundled demo model: a byte-level DeepSeek-V3-architecture LM on the Python
standard library's own sources (present on every machine: nothing is downloaded).

    python tools/train_demo.py --out core/src/kernelbay/demo            # CPU: ~30 min, 2 cores
    python tools/train_demo.py --out DIR --device cuda                  # a few minutes on a GPU

Deterministic given --seed on one machine (torch's deterministic algorithms; the corpus is
this interpreter's stdlib, so another Python version trains on slightly different text).
The held-out modules (kernelbay.demo.HELDOUT_FILES) are never trained on; the script ends by
computing held-out bits per byte with kernelbay.demo.evaluate and writing the model card.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
import sysconfig
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "core", "src"))

from kernelbay.demo import (  # noqa: E402
    BOS_ID,
    EOS_ID,
    HELDOUT_FILES,
    PAD_ID,
    VOCAB_SIZE,
    heldout_text,
)
from kernelbay.demo.evaluate import WINDOW, bits_per_byte  # noqa: E402
from kernelbay.demo.tokenizer import build_tokenizer  # noqa: E402

#: The demo architecture: MLA attention, one dense first layer, then routed + shared experts.
MODEL = dict(
    vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
    n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
    first_k_dense_replace=1, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32,
    qk_rope_head_dim=16, v_head_dim=32, max_position_embeddings=1024, rope_theta=10000.0,
    routed_scaling_factor=1.0, norm_topk_prob=True, tie_word_embeddings=False,
    bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, rms_norm_eps=1e-6,
)


def corpus_files(root: str | None = None) -> list[str]:
    """The stdlib's .py files (sorted), minus site-packages and the held-out modules.

    ``root`` is a standard-library folder (default: this interpreter's), e.g. another
    CPython's sources unpacked, to train on the same text on every machine."""
    root = root or sysconfig.get_paths()["stdlib"]
    held = {os.path.join(root, name) for name in HELDOUT_FILES}
    files = sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True))
    return [f for f in files if "site-packages" not in f and f not in held]


def load_corpus(root: str | None = None) -> torch.Tensor:
    """All training files as one byte stream, files separated by EOS."""
    chunks: list[bytes] = []
    for path in corpus_files(root):
        with open(path, "rb") as f:
            chunks.append(f.read())
    stream = bytearray()
    for chunk in chunks:
        stream += chunk
        stream.append(0)  # placeholder, replaced by EOS below
    data = torch.frombuffer(bytearray(stream), dtype=torch.uint8).long()
    ends = torch.tensor([len(c) for c in chunks]).cumsum(0) + torch.arange(len(chunks))
    data[ends] = EOS_ID
    return data


def batches(data: torch.Tensor, batch: int, seq: int, gen: torch.Generator):
    """Endless random windows: [BOS] + seq bytes as input, the following bytes as targets."""
    while True:
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
        windows = torch.stack([data[s:s + seq + 1] for s in starts.tolist()])
        bos = torch.full((batch, 1), BOS_ID, dtype=torch.long)
        inputs = torch.cat([bos, windows[:, :-1]], dim=1)
        yield inputs, windows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder to write the checkpoint into")
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=WINDOW)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--corpus", help="standard-library folder to train on (default: this "
                        "interpreter's)")
    args = parser.parse_args()

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(args.seed)
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    device = torch.device(args.device)
    config = DeepseekV3Config(**MODEL)
    model = DeepseekV3ForCausalLM(config).to(device)
    model.config._attn_implementation = "eager"
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.2f} M parameters ({params * 2 / 2**20:.2f} MiB in bf16)",
          flush=True)
    data = load_corpus(args.corpus)
    files = corpus_files(args.corpus)
    print(f"corpus: {len(files)} files, {len(data) / 1e6:.1f} M bytes", flush=True)
    gen = torch.Generator().manual_seed(args.seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": other, "weight_decay": 0.0}], lr=args.lr,
                            betas=(0.9, 0.95))
    warmup = max(1, args.steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))

    autocast = device.type == "cuda"
    started = time.perf_counter()
    model.train()
    stream = batches(data, args.batch, args.seq, gen)
    for step in range(args.steps):
        inputs, targets = next(stream)
        inputs, targets = inputs.to(device), targets.to(device)
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB_SIZE),
                                                 targets.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step:5d}  loss {loss.item():.4f}  bits/byte "
                  f"{loss.item() / math.log(2):.3f}  {time.perf_counter() - started:.0f}s",
                  flush=True)
    train_seconds = time.perf_counter() - started
    model.eval()
    model = model.to(torch.bfloat16)

    def logits_fn(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=torch.tensor([ids], device=device)).logits[0].float().cpu()

    bpb = bits_per_byte(logits_fn, heldout_text())
    print(f"held-out bits per byte (bf16 weights): {bpb:.4f}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out)
    build_tokenizer().save(os.path.join(args.out, "tokenizer.json"))
    size = os.path.getsize(os.path.join(args.out, "model.safetensors"))
    stats = {"parameters": params, "safetensors_bytes": size, "heldout_bits_per_byte": bpb,
             "steps": args.steps, "batch": args.batch, "seq": args.seq, "lr": args.lr,
             "seed": args.seed, "device": str(device),
             "device_name": (torch.cuda.get_device_name() if device.type == "cuda"
                             else "cpu"),
             "train_seconds": round(train_seconds, 1), "torch": torch.__version__,
             "python": sys.version.split()[0], "corpus_files": len(files),
             "corpus": args.corpus or sysconfig.get_paths()["stdlib"],
             "corpus_bytes": len(data)}
    with open(os.path.join(args.out, "training.json"), "w", encoding="utf-8") as f:
        json.dump(stats, f, indent=2)
    print(json.dumps(stats), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
