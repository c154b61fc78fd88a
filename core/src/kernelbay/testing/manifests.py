"""Manifests of quantized checkpoints, for comparing a writer's output with a vendor
exporter's: tensor names with layer and expert indices collapsed, dtypes, shapes in terms of
the source weight's [N, K], and one digest of the tensor bytes."""

from __future__ import annotations

import hashlib
from typing import Any

from kernelbay.checkpoint import CheckpointFolder, collapse_index

__all__ = ["file_sha256", "named_shape", "tensor_digest", "tensor_table"]


def named_shape(shape: tuple[int, ...], source: tuple[int, ...] | None) -> list[str] | str:
    """``shape`` written against the source weight's [N, K] (``"as source"`` when equal;
    dimensions named ``N``, ``K``, ``K/2``, ``K/16``, ``K/32`` where they match)."""
    if source is not None and shape == source:
        return "as source"
    if source is None or len(source) != 2:
        return [str(d) for d in shape]
    n, k = source
    named = []
    for i, d in enumerate(shape):
        if i == 0 and d == n:
            named.append("N")
            continue
        options = {"K": k, "K/2": k // 2, "K/16": k // 16, "K/32": k // 32}
        named.append(next((key for key, v in options.items() if v == d), str(d)))
    return named


def tensor_table(folder: CheckpointFolder, source: CheckpointFolder) -> dict[str, dict[str, Any]]:
    """Per collapsed name (``model.layers.*.mlp.experts.*.up_proj.weight``): dtype, shape
    against the source weight, count. Tensors sharing a collapsed name must agree."""
    tensors: dict[str, dict[str, Any]] = {}
    for name, info in sorted(folder.tensors.items()):
        module = name.rpartition(".")[0]
        origin = source.tensors.get(name) or source.tensors.get(f"{module}.weight")
        entry = {"dtype": info.dtype,
                 "shape": named_shape(info.shape, origin.shape if origin is not None else None)}
        key = collapse_index(name)
        seen = tensors.setdefault(key, {**entry, "count": 0})
        if {k: seen[k] for k in entry} != entry:
            raise AssertionError(f"{name}: {entry} differs from other {key} tensors: {seen}")
        seen["count"] += 1
    return tensors


def tensor_digest(folder: CheckpointFolder, skip: tuple[str, ...] = ()) -> str:
    """sha256 of every tensor's name, dtype, shape and bytes (sorted by name), except those
    whose last name component is in ``skip``."""
    import torch
    from safetensors import safe_open

    h = hashlib.sha256()
    for name in sorted(folder.tensors):
        if name.rsplit(".", 1)[-1] in skip:
            continue
        info = folder.tensors[name]
        with safe_open(info.file, framework="pt") as f:
            t = f.get_tensor(name)
        h.update(f"{name}|{info.dtype}|{list(info.shape)}|".encode())
        h.update(bytes(t.reshape(-1).view(torch.uint8).numpy().tobytes()))
    return h.hexdigest()


def file_sha256(path: str) -> str:
    """sha256 of a file's bytes."""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()
