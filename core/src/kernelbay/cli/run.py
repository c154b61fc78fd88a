"""``kernelbay run MODEL``: generate with the selected backends, streaming the text."""

from __future__ import annotations

import sys
import time

from kernelbay.policy import Policy

__all__ = ["run_generate"]


#: The demo model's defaults: a function with a docstring, sampled (greedy decoding of a
#: byte-level model falls into indentation runs; see the model card).
DEMO_PROMPT = 'def read_config(path):\n    """'
DEMO_TEMPERATURE, DEMO_TOP_P = 0.7, 0.95


def run_generate(policy: Policy, model: str | None, *, prompt: str | None, max_tokens: int,
                 temperature: float | None, top_k: int, top_p: float | None, seed: int,
                 tp_size: int, device: str | None, dtype: str | None, kv_cache: str,
                 quantize: str | None = None, speculative: str | None = None,
                 num_speculative_tokens: int = 4) -> int:
    """Load ``model`` (default: the bundled demo, optionally quantized first), stream one
    completion of ``prompt``, then print speed and the chosen backends."""
    from kernelbay.cli.explain import summary_lines
    from kernelbay.engine import LLM, SamplingParams, SpeculativeConfig

    demo = model is None
    if demo:
        from kernelbay.demo import demo_path

        model = demo_path()
        prompt = DEMO_PROMPT if prompt is None else prompt
        temperature = DEMO_TEMPERATURE if temperature is None else temperature
        top_p = DEMO_TOP_P if top_p is None else top_p
        print(f"[kernelbay demo model: {model}]")
    assert model is not None
    if quantize:
        from kernelbay.cli.quantize_cmd import cached_quantized

        model = cached_quantized(policy, model, quantize)
    prompt = "def fibonacci(n):" if prompt is None else prompt
    temperature = 0.0 if temperature is None else temperature
    top_p = 1.0 if top_p is None else top_p

    started = time.perf_counter()
    llm = LLM(model, device=device, dtype=dtype, tensor_parallel_size=tp_size,
              kv_cache=kv_cache, policy=policy,
              speculative=(SpeculativeConfig(speculative, num_speculative_tokens)
                           if speculative else None))
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
        accepted = (f", {out.accepted_length:.2f} tokens per target step"
                    if llm.proposer is not None else "")
        print(f"\n[{len(out.token_ids)} tokens, {out.tokens_per_second:.1f} tokens/s"
              f"{accepted}, finish: {out.finish_reason}, loaded in {loaded:.1f}s on "
              f"{llm.capability.describe()}]")
        for line in summary_lines(llm.plan):
            print(line)
    return 0
