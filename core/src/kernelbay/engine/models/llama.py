"""Llama-family causal LMs: Llama, Mistral/Ministral and Qwen2 (GQA, RoPE, optional biases,
optional sliding window, tied embeddings). Module names mirror the Hugging Face checkpoints."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernelbay.engine.build import ModelBuilder
from kernelbay.engine.models.base import CausalLM
from kernelbay.engine.modules import ForwardMeta, VocabParallelEmbedding
from kernelbay.engine.rope import Rope, rope_from_config
from kernelbay.errors import ConfigError
from kernelbay.requests import AttentionRequest

__all__ = ["LlamaForCausalLM"]


def _sliding_windows(b: ModelBuilder, layers: int) -> list[int | None]:
    """Per-layer sliding window from ``layer_types`` or the older flags, else none."""
    window = b.config_value("sliding_window")
    types = b.config_value("layer_types")
    if isinstance(types, list) and len(types) == layers:
        return [window if t == "sliding_attention" else None for t in types]
    if b.config.model_type == "qwen2" and not b.config_value("use_sliding_window", False):
        return [None] * layers
    return [window if isinstance(window, int) else None] * layers


class LlamaAttention(nn.Module):
    """Self-attention: q/k/v projections, RoPE, paged attention, output projection."""

    def __init__(self, b: ModelBuilder, prefix: str, window: int | None) -> None:
        super().__init__()
        c = b.config
        hidden, heads, kv_heads, dim = (c.hidden_size or 0, c.num_attention_heads or 0,
                                        c.num_kv_heads, c.head_size)
        self.heads, self.kv_heads, self.dim = heads // b.tp.size, kv_heads // b.tp.size, dim
        self.q_proj = b.linear(f"{prefix}.q_proj", hidden, heads * dim)
        self.k_proj = b.linear(f"{prefix}.k_proj", hidden, kv_heads * dim)
        self.v_proj = b.linear(f"{prefix}.v_proj", hidden, kv_heads * dim)
        self.o_proj = b.linear(f"{prefix}.o_proj", heads * dim, hidden)
        kind = "mha" if kv_heads == heads else ("mqa" if kv_heads == 1 else "gqa")
        request = AttentionRequest(kind, self.heads, self.kv_heads, dim, dtype=b.dtype_name,
                                   kv_cache=b.kv_cache, page_size=b.page_size,
                                   sliding_window=window)
        self.attn = b.attention(request, dim ** -0.5)

    def forward(self, x: torch.Tensor, rope: Rope, cos: torch.Tensor, sin: torch.Tensor,
                meta: ForwardMeta) -> torch.Tensor:
        tokens = x.shape[0]
        q = rope.apply(self.q_proj(x).view(tokens, self.heads, self.dim), cos, sin)
        k = rope.apply(self.k_proj(x).view(tokens, self.kv_heads, self.dim), cos, sin)
        v = self.v_proj(x).view(tokens, self.kv_heads, self.dim)
        out = self.attn(q, k, v, meta)
        return self.o_proj(out.reshape(tokens, self.heads * self.dim))  # type: ignore[no-any-return]


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, b: ModelBuilder, prefix: str, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = b.linear(f"{prefix}.gate_proj", hidden, intermediate)
        self.up_proj = b.linear(f"{prefix}.up_proj", hidden, intermediate)
        self.down_proj = b.linear(f"{prefix}.down_proj", intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # type: ignore[no-any-return]


class LlamaDecoderLayer(nn.Module):
    """Pre-norm residual block: attention, then MLP."""

    def __init__(self, b: ModelBuilder, index: int, window: int | None) -> None:
        super().__init__()
        prefix = f"model.layers.{index}"
        hidden = b.config.hidden_size or 0
        self.input_layernorm = b.norm(hidden)
        self.self_attn = LlamaAttention(b, f"{prefix}.self_attn", window)
        self.post_attention_layernorm = b.norm(hidden)
        self.mlp = LlamaMLP(b, f"{prefix}.mlp", hidden, b.config.intermediate_size or 0)

    def forward(self, x: torch.Tensor, rope: Rope, cos: torch.Tensor, sin: torch.Tensor,
                meta: ForwardMeta) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, cos, sin, meta)
        return x + self.mlp(self.post_attention_layernorm(x))  # type: ignore[no-any-return]


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm."""

    def __init__(self, b: ModelBuilder) -> None:
        super().__init__()
        c = b.config
        count = c.num_hidden_layers or 0
        self.embed_tokens = VocabParallelEmbedding(c.vocab_size or 0, c.hidden_size or 0, b.tp,
                                                   b.dtype, b.device)
        windows = _sliding_windows(b, count)
        self.layers = nn.ModuleList(LlamaDecoderLayer(b, i, windows[i]) for i in range(count))
        self.norm = b.norm(c.hidden_size or 0)


class LlamaForCausalLM(CausalLM):
    """The Llama family's causal LM on selected backends."""

    def __init__(self, b: ModelBuilder) -> None:
        super().__init__()
        c = b.config
        heads, kv_heads = c.num_attention_heads or 0, c.num_kv_heads
        if heads % b.tp.size or kv_heads % b.tp.size:
            raise ConfigError(f"{b.folder.file('config.json')}: {heads} attention heads and "
                              f"{kv_heads} KV heads must both be divisible by the "
                              f"tensor-parallel size {b.tp.size}")
        self.model = LlamaModel(b)
        self.build_head(b)
        self.rope = rope_from_config(c.head_size, c.rope_theta_value, c.rope_scaling_dict,
                                     c.max_position_embeddings or 4096)
