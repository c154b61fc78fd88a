"""Tiny Hugging Face checkpoints made with transformers, for engine parity tests."""

from __future__ import annotations

import os
from typing import Any

import torch

LLAMA_FAMILY: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama", rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "mistral": dict(model_type="mistral", sliding_window=None),
    "qwen2": dict(model_type="qwen2"),
}


def save_tiny(path: str, family: str, seed: int = 0, dtype: torch.dtype = torch.float32,
              **overrides: Any) -> str:
    """A random tiny model of ``family`` saved with ``save_pretrained`` into ``path``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    fields: dict[str, Any] = dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=160, max_position_embeddings=256,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    fields.update(LLAMA_FAMILY[family])
    fields.update(overrides)
    model_type = fields.pop("model_type")
    config = AutoConfig.for_model(model_type, **fields)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():  # make every weight matter, biases included
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.5)
    model.save_pretrained(path)
    return path


def reference(path: str, dtype: torch.dtype = torch.float32) -> Any:
    """transformers' own model for ``path`` (the numerical reference)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def greedy_reference(model: Any, ids: list[int], n: int) -> list[int]:
    """``n`` greedy tokens from transformers, with EOS disabled."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return [int(t) for t in out[0, len(ids):]]


def tmp_model(tmp_path: Any, family: str, **kw: Any) -> str:
    return save_tiny(os.path.join(str(tmp_path), family), family, **kw)
