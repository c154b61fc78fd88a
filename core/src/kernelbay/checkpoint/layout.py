"""Naming conventions of Hugging Face checkpoints: layer roles and plain linear modules."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from kernelbay.requests import LayerRole

if TYPE_CHECKING:
    from kernelbay.checkpoint.tensors import TensorInfo
    from kernelbay.layers.checkpoint_format import LinearModule

__all__ = ["beyond_layers", "collapse_index", "linear_role", "plain_linear_modules"]

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def beyond_layers(name: str, num_hidden_layers: int | None) -> bool:
    """Whether ``name`` belongs to no layer the model runs: a rotary cache of an old export,
    or a layer past ``num_hidden_layers`` (DeepSeek's multi-token-prediction layers)."""
    if name.endswith("rotary_emb.inv_freq"):
        return True
    match = _LAYER.search(name)
    return (match is not None and num_hidden_layers is not None
            and int(match.group(1)) >= num_hidden_layers)

# Last name component -> role. Names from Llama, Mistral, Qwen2 and DeepSeek-V3 exports.
_ROLE_BY_LEAF = {
    "q_proj": LayerRole.ATTN_QKV, "k_proj": LayerRole.ATTN_QKV, "v_proj": LayerRole.ATTN_QKV,
    "qkv_proj": LayerRole.ATTN_QKV, "q_a_proj": LayerRole.ATTN_QKV,
    "q_b_proj": LayerRole.ATTN_QKV, "kv_a_proj_with_mqa": LayerRole.ATTN_QKV,
    "kv_b_proj": LayerRole.ATTN_QKV, "o_proj": LayerRole.ATTN_OUT,
    "gate_proj": LayerRole.MLP_GATE_UP, "up_proj": LayerRole.MLP_GATE_UP,
    "gate_up_proj": LayerRole.MLP_GATE_UP, "down_proj": LayerRole.MLP_DOWN,
    "lm_head": LayerRole.LM_HEAD, "gate": LayerRole.ROUTER,
}
_NOT_LINEAR = ("embed_tokens", "embed", "wte", "norm", "layernorm")


def linear_role(module: str) -> str:
    """Role of a linear module from its name (``...experts.3.up_proj`` -> ``moe_expert``)."""
    if ".experts." in module:
        return LayerRole.MOE_EXPERT
    leaf = module.rsplit(".", 1)[-1]
    return _ROLE_BY_LEAF.get(leaf, LayerRole.OTHER)


def collapse_index(module: str) -> str:
    """``model.layers.7.mlp.experts.3.up_proj`` -> ``model.layers.*.mlp.experts.*.up_proj``."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", module)


def plain_linear_modules(tensors: Mapping[str, TensorInfo]) -> Sequence[LinearModule]:
    """Each 2-D ``<module>.weight`` that is not an embedding or norm, as a linear module."""
    from kernelbay.layers.checkpoint_format import LinearModule

    found = []
    for name, info in tensors.items():
        if not name.endswith(".weight") or len(info.shape) != 2:
            continue
        module = name[: -len(".weight")]
        leaf = module.rsplit(".", 1)[-1]
        if any(part in leaf for part in _NOT_LINEAR):
            continue
        found.append(LinearModule(module, info.shape[1], info.shape[0],
                                  f"{module}.bias" in tensors, linear_role(module), info.dtype))
    return sorted(found, key=lambda m: m.name)
