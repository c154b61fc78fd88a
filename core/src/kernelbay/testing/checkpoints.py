"""Tiny checkpoints written on the fly, for tests and demos (random weights, real layout)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

__all__ = ["llama_config", "write_checkpoint", "write_tiny_llama"]


def llama_config(**overrides: Any) -> dict[str, Any]:
    """A small but complete Llama ``config.json`` (GQA, 2 layers)."""
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "dtype": "bfloat16",
    }
    config.update(overrides)
    return config


def _llama_shapes(c: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    h, i, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    d = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h),
                                          "model.norm.weight": (h,)}
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        })
    if not c.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (v, h)
    return shapes


def write_checkpoint(path: str, config: Mapping[str, Any], tensors: Mapping[str, Any],
                     extra_files: Mapping[str, Any] | None = None) -> str:
    """Write ``config.json``, ``model.safetensors`` and extra JSON files into ``path``."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(dict(config), f, indent=2)
    for name, content in (extra_files or {}).items():
        with open(os.path.join(path, name), "w", encoding="utf-8") as f:
            json.dump(content, f, indent=2)
    save_file({k: v.contiguous() for k, v in tensors.items()},
              os.path.join(path, "model.safetensors"))
    return path


def write_tiny_llama(path: str, seed: int = 0, **overrides: Any) -> str:
    """A random tiny Llama checkpoint (bf16) at ``path``; returns ``path``."""
    import torch

    config = llama_config(**overrides)
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, config.get("dtype", "bfloat16"))
    tensors = {}
    for name, shape in _llama_shapes(config).items():
        if len(shape) == 1:
            tensors[name] = torch.ones(shape, dtype=dtype)
        else:
            tensors[name] = (torch.randn(shape, generator=gen) * shape[-1] ** -0.5).to(dtype)
    return write_checkpoint(path, config, tensors)
