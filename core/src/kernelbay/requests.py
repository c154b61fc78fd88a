"""Requests: small frozen objects that each describe one decision.

Requests are torch-free and hashable (dtypes are strings such as ``"bfloat16"``), so a
decision can be cached on them and planned without a device.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, final

__all__ = [
    "UNQUANTIZED",
    "AttentionRequest",
    "CollectiveRequest",
    "FormatRequest",
    "LayerRole",
    "LinearRequest",
    "ProposerRequest",
    "QuantScheme",
]


class LayerRole:
    """Role names of linear layers (strings, so plugins may add their own)."""

    ATTN_QKV = "attn_qkv"
    ATTN_OUT = "attn_out"
    MLP_GATE_UP = "mlp_gate_up"
    MLP_DOWN = "mlp_down"
    MOE_EXPERT = "moe_expert"
    ROUTER = "router"
    LM_HEAD = "lm_head"
    OTHER = "other"


@final
@dataclass(frozen=True)
class QuantScheme:
    """How one layer's weights (and activations) are quantized.

    ``group_shape`` is the (rows along N, columns along K) block that shares one scale:
    ``(1, 16)`` for NVFP4, ``(1, 32)`` for MX formats, ``(128, 128)`` for FP8 per-block,
    ``None`` for per-tensor. ``activation`` names the activation quantization a W*A* kernel
    needs (``None``: weight-only). ``dialect`` is the producer's checkpoint dialect.
    """

    name: str
    weight_dtype: str = "bfloat16"
    group_shape: tuple[int, int] | None = None
    scale_dtype: str | None = None
    global_scale: bool = False
    activation: str | None = None
    dialect: str | None = None
    options: tuple[tuple[str, str], ...] = ()

    @property
    def is_quantized(self) -> bool:
        """False only for the unquantized scheme."""
        return self.name != "unquantized"

    def option(self, key: str, default: str | None = None) -> str | None:
        """Value of one dialect-specific option."""
        return dict(self.options).get(key, default)

    def describe(self) -> str:
        """Short text such as ``nvfp4 (modelopt, group 1x16, e4m3 scales)``."""
        if not self.is_quantized:
            return f"unquantized {self.weight_dtype}"
        bits = [b for b in (self.dialect,) if b]
        if self.group_shape is not None:
            bits.append(f"group {self.group_shape[0]}x{self.group_shape[1]}")
        else:
            bits.append("per-tensor")
        if self.scale_dtype:
            bits.append(f"{self.scale_dtype} scales")
        if self.activation:
            bits.append(f"activations {self.activation}")
        return f"{self.name} ({', '.join(bits)})"


UNQUANTIZED = QuantScheme("unquantized")


@final
@dataclass(frozen=True)
class LinearRequest:
    """One linear layer as a backend sees it: ``y = x W^T (+ b)``, W of shape [N, K].

    ``in_features`` (K) and ``out_features`` (N) are this rank's shard under tensor parallel.
    """

    in_features: int
    out_features: int
    scheme: QuantScheme = UNQUANTIZED
    activation_dtype: str = "bfloat16"
    bias: bool = False
    role: str = LayerRole.OTHER
    parallel: str = "replicated"
    tp_rank: int = 0
    tp_size: int = 1
    num_experts: int | None = None

    def describe(self) -> str:
        """Short text such as ``linear K=4096 -> N=14336, nvfp4 (...), bfloat16 activations``."""
        tp = f", tp {self.tp_rank}/{self.tp_size} {self.parallel}" if self.tp_size > 1 else ""
        experts = f", {self.num_experts} experts" if self.num_experts else ""
        return (f"{self.role} K={self.in_features} -> N={self.out_features}, "
                f"{self.scheme.describe()}, {self.activation_dtype} activations{experts}{tp}")


@final
@dataclass(frozen=True)
class AttentionRequest:
    """One attention layer: its kind (mha, gqa, mqa, mla), head shapes and KV-cache choice.

    For MLA, ``kv_lora_rank`` and ``rope_dim`` give the latent record (e.g. 512 + 64) and
    ``head_dim`` is the query/key head dim used for scaling. ``kv_cache`` is ``"auto"`` (same
    as ``dtype``) or a record kind such as ``"bf16"``, ``"fp8"``, ``"mxfp8"``.
    """

    attention: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int | None = None
    kv_lora_rank: int | None = None
    rope_dim: int | None = None
    dtype: str = "bfloat16"
    kv_cache: str = "auto"
    page_size: int = 16
    sliding_window: int | None = None
    sparse_topk: int | None = None

    def describe(self) -> str:
        """Short text such as ``gqa 32q/8kv heads x 128, kv cache auto, page 16``."""
        if self.attention == "mla":
            shape = (f"mla {self.num_heads} heads, latent {self.kv_lora_rank}+{self.rope_dim}")
        else:
            shape = (f"{self.attention} {self.num_heads}q/{self.num_kv_heads}kv heads x "
                     f"{self.head_dim}")
        return f"{shape}, {self.dtype}, kv cache {self.kv_cache}, page {self.page_size}"


@final
@dataclass(frozen=True)
class ProposerRequest:
    """A speculative proposer for one target model: method, block size and vocabulary."""

    method: str
    num_speculative_tokens: int
    vocab_size: int
    model_type: str = ""
    hidden_size: int = 0
    drafter: str | None = None

    def describe(self) -> str:
        """Short text such as ``ngram, k=8, vocab 32000``."""
        return f"{self.method}, k={self.num_speculative_tokens}, vocab {self.vocab_size}"


@final
@dataclass(frozen=True)
class CollectiveRequest:
    """One collective across tensor-parallel ranks.

    ``op`` is ``all_reduce``, ``all_gather``, ``reduce_scatter`` or ``gemm_all_reduce``;
    ``transport`` is the ``torch.distributed`` backend (``gloo``, ``nccl``).
    """

    op: str
    world_size: int
    dtype: str = "bfloat16"
    transport: str = "gloo"

    def describe(self) -> str:
        """Short text such as ``all_reduce over 2 ranks (nccl, bfloat16)``."""
        return f"{self.op} over {self.world_size} ranks ({self.transport}, {self.dtype})"


@final
@dataclass(frozen=True)
class FormatRequest:
    """A checkpoint's quantization config, for the formats to recognise.

    ``config_json`` is the canonical JSON of the config (hashable); ``source`` names the file
    it came from. ``quant_method`` is ``None`` for an unquantized checkpoint.
    """

    quant_method: str | None
    config_json: str = "{}"
    source: str = ""
    extra_json: str = "{}"

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None, source: str = "",
                    extra: Mapping[str, Any] | None = None) -> FormatRequest:
        """Build from a quantization config mapping (``None`` for unquantized).

        ``extra`` carries side files such as ``hf_quant_config.json``'s ``quantization``.
        """
        method = None if config is None else config.get("quant_method")
        # Key order is kept: some dialects (Quark's layer patterns) match first-listed first.
        return cls(None if method is None else str(method), json.dumps(dict(config or {})),
                   source, json.dumps(dict(extra or {})))

    @property
    def config(self) -> dict[str, Any]:
        """The parsed quantization config (a fresh copy each call)."""
        return dict(json.loads(self.config_json))

    @property
    def extra(self) -> dict[str, Any]:
        """Parsed side-file config (``hf_quant_config.json``'s ``quantization``), or empty."""
        return dict(json.loads(self.extra_json))

    def describe(self) -> str:
        """Short text such as ``quant_method 'modelopt' from config.json``."""
        if self.quant_method is None:
            return "no quantization config"
        return f"quant_method {self.quant_method!r}" + (f" from {self.source}" if self.source
                                                         else "")
