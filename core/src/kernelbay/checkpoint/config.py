"""Typed models of a checkpoint's JSON files: config.json, hf_quant_config.json, the index.

Unknown fields are kept (``extra="allow"``); a field with an invalid value raises
``CheckpointError`` naming the file and the field.
"""

from __future__ import annotations

import json
import os
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kernelbay.errors import CheckpointError

__all__ = ["HFQuantConfig", "ModelConfig", "SafetensorsIndex", "load_json_model"]

_DTYPE_NAMES = {"bfloat16", "float16", "float32", "float64", "bf16", "fp16", "fp32", "half",
                "float", "auto"}
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16",
                  "fp32": "float32", "float": "float32"}


class ModelConfig(BaseModel):
    """``config.json`` of a Hugging Face causal LM (Llama, Mistral, Qwen2, DeepSeek-V3 ...).

    Reads both spellings transformers has used: ``dtype`` / ``torch_dtype`` and
    ``rope_parameters`` / top-level ``rope_theta`` + ``rope_scaling``.
    """

    model_config = ConfigDict(extra="allow", protected_namespaces=())

    architectures: list[str] = Field(default_factory=list)
    model_type: str = ""
    hidden_size: int | None = Field(default=None, gt=0)
    intermediate_size: int | None = Field(default=None, gt=0)
    num_hidden_layers: int | None = Field(default=None, ge=0)
    num_attention_heads: int | None = Field(default=None, gt=0)
    num_key_value_heads: int | None = Field(default=None, gt=0)
    head_dim: int | None = Field(default=None, gt=0)
    vocab_size: int | None = Field(default=None, gt=0)
    max_position_embeddings: int | None = Field(default=None, gt=0)
    rms_norm_eps: float | None = Field(default=None, gt=0)
    tie_word_embeddings: bool = False
    dtype: str | None = None
    torch_dtype: str | None = None
    rope_theta: float | None = Field(default=None, gt=0)
    rope_scaling: dict[str, Any] | None = None
    rope_parameters: dict[str, Any] | None = None
    quantization_config: dict[str, Any] | None = None
    # DeepSeek-V3 (MLA + MoE)
    q_lora_rank: int | None = Field(default=None, gt=0)
    kv_lora_rank: int | None = Field(default=None, gt=0)
    qk_nope_head_dim: int | None = Field(default=None, gt=0)
    qk_rope_head_dim: int | None = Field(default=None, gt=0)
    v_head_dim: int | None = Field(default=None, gt=0)
    n_routed_experts: int | None = Field(default=None, gt=0)
    n_shared_experts: int | None = Field(default=None, ge=0)
    num_experts_per_tok: int | None = Field(default=None, gt=0)
    moe_intermediate_size: int | None = Field(default=None, gt=0)
    first_k_dense_replace: int | None = Field(default=None, ge=0)

    @field_validator("dtype", "torch_dtype")
    @classmethod
    def _known_dtype(cls, value: str | None) -> str | None:
        if value is None:
            return None
        text = str(value).removeprefix("torch.")
        if text not in _DTYPE_NAMES:
            raise ValueError(f"{value!r} is not a dtype name; valid: {sorted(_DTYPE_NAMES)}")
        return _DTYPE_ALIASES.get(text, text)

    @property
    def dtype_name(self) -> str:
        """The checkpoint's float dtype name (``dtype`` first, then ``torch_dtype``)."""
        value = self.dtype or self.torch_dtype or "float32"
        return "float32" if value == "auto" else value

    @property
    def rope_theta_value(self) -> float:
        """RoPE base, from ``rope_parameters`` or the top-level field (default 10000)."""
        if self.rope_parameters and "rope_theta" in self.rope_parameters:
            return float(self.rope_parameters["rope_theta"])
        return float(self.rope_theta or 10000.0)

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        """RoPE scaling parameters (``rope_type`` etc.), from either spelling, or ``None``."""
        params = self.rope_parameters or self.rope_scaling
        if not params:
            return None
        kind = params.get("rope_type", params.get("type", "default"))
        return None if kind == "default" else dict(params)

    @property
    def num_kv_heads(self) -> int:
        """KV heads (defaults to the attention heads)."""
        return self.num_key_value_heads or self.num_attention_heads or 0

    @property
    def head_size(self) -> int:
        """Per-head dim: ``head_dim`` or hidden_size / heads."""
        if self.head_dim:
            return self.head_dim
        return (self.hidden_size or 0) // max(1, self.num_attention_heads or 1)


class HFQuantConfig(BaseModel):
    """``hf_quant_config.json`` written by NVIDIA ModelOpt: ``producer`` and ``quantization``."""

    model_config = ConfigDict(extra="allow")

    producer: dict[str, Any] = Field(default_factory=dict)
    quantization: dict[str, Any]


class SafetensorsIndex(BaseModel):
    """``model.safetensors.index.json``: which shard holds each tensor."""

    model_config = ConfigDict(extra="allow")

    metadata: dict[str, Any] = Field(default_factory=dict)
    weight_map: dict[str, str]

    @field_validator("weight_map")
    @classmethod
    def _inside_folder(cls, value: dict[str, str]) -> dict[str, str]:
        for tensor, shard in value.items():
            norm = os.path.normpath(shard)
            if os.path.isabs(shard) or norm.startswith(".."):
                raise ValueError(f"tensor {tensor!r} points to {shard!r}, outside the "
                                 "checkpoint folder")
            if not shard.endswith(".safetensors"):
                raise ValueError(f"tensor {tensor!r} points to {shard!r}, not a "
                                 ".safetensors file")
        return value


ModelT = TypeVar("ModelT", bound=BaseModel)


def load_json_model(path: str, model: type[ModelT]) -> ModelT:
    """Read ``path`` as JSON into ``model``; errors name the file and the field."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError as exc:
        raise CheckpointError(path, "file not found") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(path, f"is not readable JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(path, f"top level is {type(data).__name__}, expected an object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or None
        raise CheckpointError(path, f"{first['msg']} (got {first.get('input')!r})",
                              field=field) from exc
