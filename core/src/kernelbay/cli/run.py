"""``kernelbay run MODEL``: generate with the selected backends, streaming the text."""

from __future__ import annotations

import sys
import time

from kernelbay.policy import Policy

__all__ = ["run_generate"]


def run_generate(policy: Policy, model: str, *, prompt: str, max_tokens: int,
                 temperature: float, top_k: int, top_p: float, seed: int, tp_size: int,
                 device: str | None, dtype: str | None, kv_cache: str) -> int:
    """Load ``model``, stream one completion of ``prompt``, then print speed and backends."""
    from kernelbay.cli.explain import summary_lines
    from kernelbay.engine import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model, device=device, dtype=dtype, tensor_parallel_size=tp_size,
              kv_cache=kv_cache, policy=policy)
    loaded = time.perf_counter() - started
    is_writer = llm.tp.rank == 0
    ids = llm.encode(prompt) if llm.tokenizer is not None else [int(t) for t in prompt.split()]
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                            top_p=top_p, seed=seed)
    shown = ""
    generated: list[int] = []

    def stream(index: int, token: int) -> None:
        nonlocal shown
        if index != 0 or not is_writer:
            return
        generated.append(token)
        text = llm.decode(generated) if llm.tokenizer is not None else " ".join(
            map(str, generated))
        # Print only complete characters: a partial UTF-8 sequence decodes to U+FFFD.
        if text.startswith(shown) and not text.endswith("\ufffd"):
            sys.stdout.write(text[len(shown):])
            sys.stdout.flush()
            shown = text

    if is_writer:
        sys.stdout.write(prompt)
    out = llm.generate([ids], params, on_token=stream)[0]
    if is_writer:
        print()
        print(f"\n[{len(out.token_ids)} tokens, {out.tokens_per_second:.1f} tokens/s, "
              f"finish: {out.finish_reason}, loaded in {loaded:.1f}s on "
              f"{llm.capability.describe()}]")
        for line in summary_lines(llm.plan):
            print(line)
    return 0
