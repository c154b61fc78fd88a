"""DeepSeek-V3-style causal LMs: MLA attention (absorbed, latent KV cache, decoupled RoPE)
and routed + shared experts with DeepSeek's group-limited sigmoid router. Module names
mirror the Hugging Face checkpoints (``model.layers.{i}.self_attn.kv_b_proj`` ...).

Attention runs in the absorbed form: ``kv_b_proj``'s dense weight is split into ``W_UK``
(folded into the query) and ``W_UV`` (applied to the attention output); the selected MLA
backend caches ``[kv_a_layernorm(c_kv) | rope(k_pe)]`` per token and returns the latent
output. The routed experts run through the selected ``MoEMethod``.

Tensor parallel: heads split (q_proj / q_b_proj / kv_b_proj column, o_proj row;
q_a_proj and kv_a_proj_with_mqa replicated), expert and dense-MLP intermediates split, one
all-reduce per MoE block after routed + shared experts, vocabulary-parallel embedding/head.

Latent MoE (opt-in, ``moe_latent_size`` in config.json): the routed experts work in a
latent space; ``mlp.fc1_latent_proj`` [latent, hidden] projects down before them and
``mlp.fc2_latent_proj`` [hidden, latent] back up after (both replicated); the router and the
shared experts see the hidden state. When the back-projection is linear in its input (its
method is unquantized, without activation quantization, and it has no bias) each rank sums
its experts in the latent space, projects its partial sum up and adds the shared experts':
one all-reduce per block. Otherwise the latent sum is all-reduced before the projection and
the shared experts' sum separately: two.

Batch-invariant mode (``Policy.batch_invariant``): the matmuls this file runs itself (the
router's scores, the MLA absorption einsums) run row by row (``rowwise``), so no row's sum
order can follow the batch size.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kernelbay.engine.build import ModelBuilder
from kernelbay.engine.models.base import CausalLM
from kernelbay.engine.modules import ForwardMeta, Linear, VocabParallelEmbedding, rowwise
from kernelbay.engine.rope import Rope, rope_from_config
from kernelbay.errors import ConfigError
from kernelbay.layers.moe import MoEMethod
from kernelbay.requests import AttentionRequest

__all__ = ["DeepseekV3ForCausalLM", "latent_reduces_once", "mla_softmax_scale"]

#: q_a_layernorm and kv_a_layernorm use this epsilon whatever ``rms_norm_eps`` says.
_LATENT_NORM_EPS = 1e-6


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_softmax_scale(qk_head_dim: int, scaling: dict[str, Any] | None) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` for any
    non-default rope type that sets ``mscale_all_dim`` (as transformers does)."""
    scale: float = qk_head_dim ** -0.5
    if scaling and scaling.get("mscale_all_dim"):
        m = _yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"]))
        scale *= m * m
    return scale


class DeepseekV3Attention(nn.Module):
    """Multi-head latent attention in the absorbed form over a paged latent cache."""

    def __init__(self, b: ModelBuilder, prefix: str, scale: float) -> None:
        super().__init__()
        c = b.config
        hidden, heads = c.hidden_size or 0, c.num_attention_heads or 0
        self.nope = c.qk_nope_head_dim or 0
        self.rope_dim = c.qk_rope_head_dim or 0
        self.v_dim = c.v_head_dim or 0
        self.rank = c.kv_lora_rank or 0
        self.heads = heads // b.tp.size
        qk = self.nope + self.rope_dim
        self.q_lora_rank = c.q_lora_rank
        if self.q_lora_rank:
            self.q_a_proj = b.linear(f"{prefix}.q_a_proj", hidden, self.q_lora_rank)
            self.q_a_layernorm = b.norm(self.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = b.linear(f"{prefix}.q_b_proj", self.q_lora_rank, heads * qk)
        else:
            self.q_proj = b.linear(f"{prefix}.q_proj", hidden, heads * qk)
        self.kv_a_proj_with_mqa = b.linear(f"{prefix}.kv_a_proj_with_mqa", hidden,
                                           self.rank + self.rope_dim)
        self.kv_a_layernorm = b.norm(self.rank, _LATENT_NORM_EPS)
        self.kv_b_proj = b.linear(f"{prefix}.kv_b_proj", self.rank,
                                  heads * (self.nope + self.v_dim))
        self.o_proj = b.linear(f"{prefix}.o_proj", heads * self.v_dim, hidden)
        request = AttentionRequest("mla", self.heads, 1, qk, self.v_dim, self.rank,
                                   self.rope_dim, dtype=b.dtype_name, kv_cache=b.kv_cache,
                                   page_size=b.page_size)
        self.attn = b.attention(request, scale)
        self.batch_invariant = b.policy.batch_invariant
        self._w_uk: torch.Tensor | None = None
        self._w_uv: torch.Tensor | None = None

    def absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_UK`` [H, nope, rank] and ``W_UV`` [H, v, rank] of this rank's heads, from
        ``kv_b_proj``'s dense weight (computed once, after loading, on first use)."""
        if self._w_uk is None or self._w_uv is None:
            dense = self.kv_b_proj.method.dequantized_weight(self.kv_b_proj)
            w = dense.view(self.heads, self.nope + self.v_dim, self.rank)
            self._w_uk = w[:, :self.nope].contiguous()
            self._w_uv = w[:, self.nope:].contiguous()
        return self._w_uk, self._w_uv

    def forward(self, x: torch.Tensor, rope: Rope, cos: torch.Tensor, sin: torch.Tensor,
                meta: ForwardMeta) -> torch.Tensor:
        tokens = x.shape[0]
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q_nope, q_pe = q.view(tokens, self.heads, -1).split([self.nope, self.rope_dim], -1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], -1)
        c_kv = self.kv_a_layernorm(c_kv)
        q_pe = rope.apply(q_pe, cos, sin)
        k_pe = rope.apply(k_pe.unsqueeze(1), cos, sin).squeeze(1)
        w_uk, w_uv = self.absorbed()

        def absorb_q(t: torch.Tensor) -> torch.Tensor:
            return torch.einsum("thn,hnr->thr", t, w_uk.to(t.dtype))

        def absorb_out(t: torch.Tensor) -> torch.Tensor:
            return torch.einsum("thr,hvr->thv", t, w_uv.to(t.dtype))

        q_latent = rowwise(absorb_q, q_nope) if self.batch_invariant else absorb_q(q_nope)
        query = torch.cat([q_latent, q_pe], dim=-1)             # [T, H, rank + rope]
        latent = torch.cat([c_kv, k_pe], dim=-1)                # [T, rank + rope]
        out = self.attn(query, latent, None, meta)              # [T, H, rank]
        out = rowwise(absorb_out, out) if self.batch_invariant else absorb_out(out)
        projected: torch.Tensor = self.o_proj(out.reshape(tokens, self.heads * self.v_dim))
        return projected


class DeepseekV3MLP(nn.Module):
    """SwiGLU feed-forward (dense layers and the shared experts)."""

    def __init__(self, b: ModelBuilder, prefix: str, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = b.linear(f"{prefix}.gate_proj", hidden, intermediate)
        self.up_proj = b.linear(f"{prefix}.up_proj", hidden, intermediate)
        self.down_proj = b.linear(f"{prefix}.down_proj", intermediate, hidden)

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """The MLP output; with ``reduce=False`` this rank's partial sum (no all-reduce)."""
        h = F.silu(self.gate_proj(x)) * self.up_proj(x)
        if reduce:
            return self.down_proj(h)  # type: ignore[no-any-return]
        return self.down_proj.method.apply(self.down_proj, h)


class DeepseekV3Router(nn.Module):
    """Group-limited top-k over sigmoid scores (``noaux_tc``), all in float32.

    ``e_score_correction_bias`` only steers the choice; the weights are the unbiased sigmoid
    scores of the chosen experts (normalised when ``norm_topk_prob``), times
    ``routed_scaling_factor``.
    """

    def __init__(self, b: ModelBuilder, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.top_k = b.config.num_experts_per_tok or 1
        self.n_group = int(b.config_value("n_group", 1) or 1)
        self.topk_group = int(b.config_value("topk_group", 1) or 1)
        self.norm_topk_prob = bool(b.config_value("norm_topk_prob", True))
        self.routed_scaling_factor = float(b.config_value("routed_scaling_factor", 1.0))
        if num_experts % self.n_group or num_experts // self.n_group < 2:
            raise ConfigError(f"{b.folder.file('config.json')}: n_routed_experts "
                              f"{num_experts} must split into n_group {self.n_group} groups "
                              "of at least 2 experts")
        if self.top_k > self.topk_group * (num_experts // self.n_group):
            raise ConfigError(f"{b.folder.file('config.json')}: num_experts_per_tok "
                              f"{self.top_k} exceeds the {self.topk_group} selected groups of "
                              f"{num_experts // self.n_group} experts")
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden, dtype=torch.float32,
                                               device=b.device), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(num_experts, dtype=torch.float32, device=b.device), requires_grad=False)
        self.batch_invariant = b.policy.batch_invariant

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(topk_ids [T, k], topk_weights [T, k] float32)`` for ``x`` [T, hidden]."""
        tokens, experts = x.shape[0], self.weight.shape[0]
        xf = x.float()
        scores = (rowwise(lambda row: F.linear(row, self.weight), xf) if self.batch_invariant
                  else F.linear(xf, self.weight)).sigmoid()
        choice = scores + self.e_score_correction_bias
        group_scores = (choice.view(tokens, self.n_group, -1).topk(2, dim=-1)[0].sum(dim=-1))
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        expert_mask = (group_mask.unsqueeze(-1).expand(tokens, self.n_group,
                                                       experts // self.n_group)
                       .reshape(tokens, experts))
        choice = choice.masked_fill(~expert_mask.bool(), float("-inf"))
        topk_ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, topk_ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return topk_ids, weights * self.routed_scaling_factor


def latent_reduces_once(projection: Linear) -> bool:
    """True when ``projection`` (a latent MoE's back-projection) is linear in its input, so
    that projecting each rank's partial latent sum and all-reducing once equals projecting
    the all-reduced sum: decided from the layer's constructed method (its own scheme has no
    quantization, weights or activations) and the layer having no bias (a replicated bias
    would be added once per rank)."""
    request = projection.method.request
    return (not request.scheme.is_quantized and request.scheme.activation is None
            and not request.bias)


class DeepseekV3MoE(Linear):
    """The MoE block at ``model.layers.{i}.mlp``: a ``Linear`` running the selected
    ``MoEMethod`` (so the per-expert tensors ``experts.{e}.*`` load by name), with the
    router ``gate``, the ``shared_experts`` MLP and, for a latent MoE, the
    ``fc1_latent_proj`` / ``fc2_latent_proj`` projections as children.

    ``reduce_once`` (latent MoE only) says whether the block all-reduces once (see
    ``latent_reduces_once``); it can be cleared to force the two-reduce path.
    """

    def __init__(self, b: ModelBuilder, prefix: str) -> None:
        c = b.config
        hidden = c.hidden_size or 0
        inter = c.moe_intermediate_size or 0
        num_experts = c.n_routed_experts or 0
        latent = int(b.config_value("moe_latent_size", 0) or 0)
        super().__init__(b.moe_method(prefix, latent or hidden, inter, num_experts), b.tp,
                         b.device)
        self.gate = DeepseekV3Router(b, hidden, num_experts)
        shared = c.n_shared_experts if c.n_shared_experts is not None else 1
        self.shared_experts = (DeepseekV3MLP(b, f"{prefix}.shared_experts", hidden,
                                             inter * shared) if shared else None)
        self.fc1_latent_proj: Linear | None = None
        self.fc2_latent_proj: Linear | None = None
        self.reduce_once = False
        if latent:
            self.fc1_latent_proj = b.linear(f"{prefix}.fc1_latent_proj", hidden, latent)
            self.fc2_latent_proj = b.linear(f"{prefix}.fc2_latent_proj", latent, hidden)
            self.reduce_once = latent_reduces_once(self.fc2_latent_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_ids, topk_weights = self.gate(x)
        method: MoEMethod = self.method  # type: ignore[assignment]
        shared = self.shared_experts(x, reduce=False) if self.shared_experts else None
        if self.fc1_latent_proj is not None and self.fc2_latent_proj is not None:
            return self._latent(x, topk_ids, topk_weights, method, shared)
        out = method.apply_moe(self, x, topk_ids, topk_weights)
        if shared is not None:
            out = out + shared
        if self.tp.size > 1:
            out = self.tp.collective.all_reduce(out)
        return out

    def _latent(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                method: MoEMethod, shared: torch.Tensor | None) -> torch.Tensor:
        assert self.fc1_latent_proj is not None and self.fc2_latent_proj is not None
        # This rank's experts, summed in the latent space (a partial sum under TP).
        routed = method.apply_moe(self, self.fc1_latent_proj(x), topk_ids, topk_weights)
        reduce = self.tp.size > 1
        if self.reduce_once or not reduce:
            out: torch.Tensor = self.fc2_latent_proj(routed)
            if shared is not None:
                out = out + shared
            return self.tp.collective.all_reduce(out) if reduce else out
        out = self.fc2_latent_proj(self.tp.collective.all_reduce(routed))
        if shared is not None:
            out = out + self.tp.collective.all_reduce(shared)
        return out


class DeepseekV3DecoderLayer(nn.Module):
    """Pre-norm residual block: MLA attention, then a dense MLP or the MoE block."""

    def __init__(self, b: ModelBuilder, index: int, scale: float) -> None:
        super().__init__()
        c = b.config
        prefix = f"model.layers.{index}"
        hidden = c.hidden_size or 0
        self.input_layernorm = b.norm(hidden)
        self.self_attn = DeepseekV3Attention(b, f"{prefix}.self_attn", scale)
        self.post_attention_layernorm = b.norm(hidden)
        dense = c.first_k_dense_replace if c.first_k_dense_replace is not None else 3
        self.mlp: nn.Module = (
            DeepseekV3MLP(b, f"{prefix}.mlp", hidden, c.intermediate_size or 0)
            if index < dense else DeepseekV3MoE(b, f"{prefix}.mlp"))

    def forward(self, x: torch.Tensor, rope: Rope, cos: torch.Tensor, sin: torch.Tensor,
                meta: ForwardMeta) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, cos, sin, meta)
        return x + self.mlp(self.post_attention_layernorm(x))  # type: ignore[no-any-return]


class DeepseekV3Model(nn.Module):
    """Embedding, decoder layers, final norm."""

    def __init__(self, b: ModelBuilder, scale: float) -> None:
        super().__init__()
        c = b.config
        self.embed_tokens = VocabParallelEmbedding(c.vocab_size or 0, c.hidden_size or 0, b.tp,
                                                   b.dtype, b.device)
        self.layers = nn.ModuleList(DeepseekV3DecoderLayer(b, i, scale)
                                    for i in range(c.num_hidden_layers or 0))
        self.norm = b.norm(c.hidden_size or 0)


class DeepseekV3ForCausalLM(CausalLM):
    """The DeepSeek-V3 family's causal LM on selected backends."""

    def __init__(self, b: ModelBuilder) -> None:
        super().__init__()
        c = b.config
        path = b.folder.file("config.json")
        heads = c.num_attention_heads or 0
        if heads % b.tp.size:
            raise ConfigError(f"{path}: {heads} attention heads must be divisible by the "
                              f"tensor-parallel size {b.tp.size}")
        if not (c.kv_lora_rank and c.qk_nope_head_dim and c.qk_rope_head_dim and c.v_head_dim):
            raise ConfigError(f"{path}: MLA needs kv_lora_rank, qk_nope_head_dim, "
                              f"qk_rope_head_dim and v_head_dim, got {c.kv_lora_rank}, "
                              f"{c.qk_nope_head_dim}, {c.qk_rope_head_dim}, {c.v_head_dim}")
        act = b.config_value("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{path}: hidden_act {act!r} is not supported; supported: 'silu'")
        scaling = c.rope_scaling_dict
        scale = mla_softmax_scale(c.qk_nope_head_dim + c.qk_rope_head_dim, scaling)
        self.model = DeepseekV3Model(b, scale)
        self.build_head(b)
        interleave = b.config_value("rope_interleave", True)
        self.rope = rope_from_config(c.qk_rope_head_dim, c.rope_theta_value, scaling,
                                     c.max_position_embeddings or 4096,
                                     interleaved=True if interleave is None else bool(interleave))
