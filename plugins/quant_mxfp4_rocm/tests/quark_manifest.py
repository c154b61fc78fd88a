"""The manifest of an amd-quark MXFP4 export: what the writer must reproduce.

Run on a folder exported by amd-quark (see the README's "Checking against Quark") to record
the fixture ``fixtures/quark_mxfp4_demo.json``:

    python plugins/quant_mxfp4_rocm/tests/quark_manifest.py EXPORT_DIR > \\
        plugins/quant_mxfp4_rocm/tests/fixtures/quark_mxfp4_demo.json

The tests compute the same manifest of the writer's output and compare. Layer and expert
indices are collapsed in ``tensors`` (``model.layers.*.mlp.experts.*.up_proj.weight``) and
shapes are written in terms of the source weight's [N, K]; tensor bytes are compared
through one digest; the ``quantization_config`` exactly.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Any

from kernelbay.checkpoint import CheckpointFolder, collapse_index


def _shape(shape: tuple[int, ...], source: tuple[int, ...] | None) -> list[str] | str:
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


def digest(folder: CheckpointFolder) -> str:
    """sha256 of every tensor's name, dtype, shape and bytes, sorted by name."""
    import torch
    from safetensors import safe_open

    h = hashlib.sha256()
    for name in sorted(folder.tensors):
        info = folder.tensors[name]
        with safe_open(info.file, framework="pt") as f:
            t = f.get_tensor(name)
        h.update(f"{name}|{info.dtype}|{list(info.shape)}|".encode())
        h.update(bytes(t.reshape(-1).view(torch.uint8).numpy().tobytes()))
    return h.hexdigest()


def manifest(path: str, source: str) -> dict[str, Any]:
    """The manifest of the Quark MXFP4 checkpoint at ``path`` quantized from ``source``."""
    folder, src = CheckpointFolder(path), CheckpointFolder(source)
    tensors: dict[str, dict[str, Any]] = {}
    for name, info in sorted(folder.tensors.items()):
        module = name.rpartition(".")[0]
        origin = src.tensors.get(name) or src.tensors.get(f"{module}.weight")
        entry = {"dtype": info.dtype,
                 "shape": _shape(info.shape, origin.shape if origin is not None else None)}
        key = collapse_index(name)
        seen = tensors.setdefault(key, {**entry, "count": 0})
        if {k: seen[k] for k in entry} != entry:
            raise AssertionError(f"{name}: {entry} differs from other {key} tensors: {seen}")
        seen["count"] += 1
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    with open(os.path.join(source, "model.safetensors"), "rb") as f:
        source_sha = hashlib.sha256(f.read()).hexdigest()
    return {
        "source_sha256": source_sha,
        "tensor_count": len(folder.tensors),
        "tensors": tensors,
        "quantization_config": config["quantization_config"],
        "digest": digest(folder),
    }


if __name__ == "__main__":
    from kernelbay.demo import demo_path

    record = manifest(sys.argv[1], demo_path())
    record = {"recorded_with": "amd-quark 0.13 ModelQuantizer(LLMTemplate.get('deepseek_v3')"
                               ".get_config('mxfp4')) + export_safetensors, transformers "
                               "4.57.6, torch 2.13.0 CPU, on the kernelbay demo model", **record}
    json.dump(record, sys.stdout, indent=1)
    sys.stdout.write("\n")
