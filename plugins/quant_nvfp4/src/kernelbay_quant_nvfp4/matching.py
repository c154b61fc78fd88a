"""Module-name matching rules of the two NVFP4 dialects (torch-free).

ModelOpt (``exclude_modules`` / ``ignore`` / ``quantized_layers``): an entry names a module
exactly, or a module prefix (``model.layers.0`` covers ``model.layers.0.mlp.down_proj``), or
is an ``fnmatch`` wildcard (``model.layers.*.mlp*``). They are tried in that order, so an
exact entry always wins over a prefix, and a prefix over a wildcard.

compressed-tensors (``targets`` / ``ignore``): an entry is an exact module name, a regular
expression written ``re:<pattern>`` (matched with ``re.match``, i.e. anchored at the start,
as compressed-tensors does), or a module class name (``Linear``: every linear layer).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Mapping
from typing import TypeVar

__all__ = [
    "FUSED_SHARDS",
    "LINEAR_CLASS_NAMES",
    "ct_match_level",
    "fused_shards",
    "is_never_quantized",
    "is_router",
    "modelopt_lookup",
    "modelopt_match",
]

ValueT = TypeVar("ValueT")

#: Fused projections an executor may build, and the checkpoint modules they are made of.
FUSED_SHARDS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}

#: Class names that compressed-tensors uses to target every linear layer.
LINEAR_CLASS_NAMES = frozenset({"Linear"})

# Leaves that stay in high precision whatever the config says (FORMATS.md: lm_head and the
# embeddings are exported unquantized).
_NEVER_QUANTIZED_LEAVES = ("lm_head",)
_EMBEDDING_PARTS = ("embed_tokens", "embed", "wte")
# MoE routers, as ModelOpt's default config disables them ("*router*", "*mlp.gate.*",
# "*block_sparse_moe.gate*", "*mlp.shared_expert_gate.*"): a ``gate`` directly under an MoE
# block (not ``gate_proj``), and anything named router.
_ROUTER_PARENTS = ("mlp", "block_sparse_moe", "moe")
_ROUTER_LEAVES = ("router", "shared_expert_gate")


def is_router(module: str) -> bool:
    """True for an MoE router (``model.layers.3.mlp.gate``, ``...router``): never quantized."""
    parts = module.split(".")
    if parts[-1] in _ROUTER_LEAVES:
        return True
    return parts[-1] == "gate" and len(parts) > 1 and parts[-2] in _ROUTER_PARENTS


def is_never_quantized(module: str) -> bool:
    """True for ``lm_head``, embeddings and MoE routers, which both dialects keep unquantized."""
    leaf = module.rsplit(".", 1)[-1]
    return (leaf in _NEVER_QUANTIZED_LEAVES or any(p in leaf for p in _EMBEDDING_PARTS)
            or is_router(module))


def fused_shards(module: str) -> tuple[str, ...]:
    """Checkpoint module names a fused module is made of (empty for an unfused module)."""
    parent, _, leaf = module.rpartition(".")
    shards = FUSED_SHARDS.get(leaf, ())
    return tuple(f"{parent}.{s}" if parent else s for s in shards)


def modelopt_match(module: str, patterns: Iterable[str]) -> str | None:
    """The ModelOpt entry that matches ``module`` (exact, then prefix, then wildcard), or None."""
    entries = [p for p in patterns if isinstance(p, str) and p]
    if module in entries:
        return module
    prefixes = [p for p in entries if module.startswith(p.rstrip(".") + ".")]
    if prefixes:
        return max(prefixes, key=len)  # the most specific prefix
    for pattern in entries:
        if fnmatch.fnmatchcase(module, pattern):
            return pattern
    return None


def modelopt_lookup(module: str, table: Mapping[str, ValueT]) -> tuple[str, ValueT] | None:
    """The ``(key, value)`` of ``table`` whose key matches ``module`` by ``modelopt_match``."""
    key = modelopt_match(module, table.keys())
    return None if key is None else (key, table[key])


def ct_match_level(module: str, target: str) -> int:
    """How specifically a compressed-tensors target matches ``module``.

    3: exact name, 2: ``re:`` regular expression, 1: a linear class name, 0: no match. A
    malformed regular expression raises ``ValueError`` naming it.
    """
    if target == module:
        return 3
    if target.startswith("re:"):
        try:
            return 2 if re.match(target[3:], module) is not None else 0
        except re.error as exc:
            raise ValueError(f"target {target!r} is not a valid regular expression: {exc}") from exc
    return 1 if target in LINEAR_CLASS_NAMES else 0
