"""The manifest of a ModelOpt NVFP4 export: what the writer must reproduce.

Run on a folder exported by nvidia-modelopt (see the README's "Checking against ModelOpt")
to record the fixture ``fixtures/modelopt_nvfp4_demo.json``:

    python plugins/quant_nvfp4/tests/modelopt_manifest.py EXPORT_DIR > \\
        plugins/quant_nvfp4/tests/fixtures/modelopt_nvfp4_demo.json

The tests compute the same manifest of the writer's output and compare. Layer and expert
indices are collapsed in ``tensors`` (``model.layers.*.mlp.experts.*.up_proj.weight``) and
shapes are written in terms of the source weight's [N, K]; the calibration-dependent
``input_scale`` values are kept apart (compared with a tolerance); everything else is
compared exactly, tensor bytes through one digest.
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


def _bytes(folder: CheckpointFolder, name: str) -> bytes:
    import torch
    from safetensors import safe_open

    with safe_open(folder.tensors[name].file, framework="pt") as f:
        t = f.get_tensor(name)
    return bytes(t.reshape(-1).view(torch.uint8).numpy().tobytes())


def digest(folder: CheckpointFolder, skip: tuple[str, ...] = ("input_scale",)) -> str:
    """sha256 of every tensor's name, dtype, shape and bytes (sorted by name), except those
    whose last name component is in ``skip``."""
    h = hashlib.sha256()
    for name in sorted(folder.tensors):
        if name.rsplit(".", 1)[-1] in skip:
            continue
        info = folder.tensors[name]
        h.update(f"{name}|{info.dtype}|{list(info.shape)}|".encode())
        h.update(_bytes(folder, name))
    return h.hexdigest()


def _scalar(folder: CheckpointFolder, name: str) -> float:
    import torch
    from safetensors import safe_open

    with safe_open(folder.tensors[name].file, framework="pt") as f:
        return float(f.get_tensor(name).to(torch.float64))


def shared_input_scales(folder: CheckpointFolder) -> list[list[str]]:
    """Groups of modules within one decoder layer whose ``input_scale`` values are equal.

    (``weight_scale_2`` groups are covered by the digest: bf16 weight maxima coincide too
    often for value equality to say which layers ModelOpt unified.)"""
    by_value: dict[tuple[str, float], list[str]] = {}
    for name in sorted(folder.tensors):
        if not name.endswith(".input_scale"):
            continue
        module = name.removesuffix(".input_scale")
        layer = ".".join(module.split(".")[:3])  # model.layers.N
        by_value.setdefault((layer, _scalar(folder, name)), []).append(module)
    return sorted(sorted(g) for g in by_value.values() if len(g) > 1)


def manifest(path: str, source: str) -> dict[str, Any]:
    """The manifest of the ModelOpt NVFP4 checkpoint at ``path`` quantized from ``source``."""
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
    with open(os.path.join(path, "hf_quant_config.json"), encoding="utf-8") as f:
        hf_quant = json.load(f)
    with open(os.path.join(source, "model.safetensors"), "rb") as f:
        source_sha = hashlib.sha256(f.read()).hexdigest()
    return {
        "source_sha256": source_sha,
        "tensor_count": len(folder.tensors),
        "tensors": tensors,
        "quantization_config": config["quantization_config"],
        "hf_quant_config": hf_quant,
        "digest_without_input_scale": digest(folder),
        "shared_input_scale": shared_input_scales(folder),
        "input_scale": {n: _scalar(folder, n) for n in sorted(folder.tensors)
                        if n.endswith(".input_scale")},
    }


if __name__ == "__main__":
    from kernelbay.demo import demo_path

    record = manifest(sys.argv[1], demo_path())
    record = {"recorded_with": "nvidia-modelopt 0.47.0 mtq.quantize(NVFP4_DEFAULT_CFG, max "
                               "calibration on kernelbay_quant_nvfp4/calibration.txt) + "
                               "export_hf_checkpoint, transformers 5.14.1, torch 2.13.0 CPU, "
                               "on the kernelbay demo model", **record}
    json.dump(record, sys.stdout, indent=1)
    sys.stdout.write("\n")
