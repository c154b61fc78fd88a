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

import json
import os
import sys
from typing import Any

from kernelbay.checkpoint import CheckpointFolder
from kernelbay.testing.manifests import file_sha256, tensor_digest, tensor_table


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
    folder = CheckpointFolder(path)
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    with open(os.path.join(path, "hf_quant_config.json"), encoding="utf-8") as f:
        hf_quant = json.load(f)
    return {
        "source_sha256": file_sha256(os.path.join(source, "model.safetensors")),
        "tensor_count": len(folder.tensors),
        "tensors": tensor_table(folder, CheckpointFolder(source)),
        "quantization_config": config["quantization_config"],
        "hf_quant_config": hf_quant,
        # input_scale values depend on calibration: compared apart, with a tolerance
        "digest_without_input_scale": tensor_digest(folder, skip=("input_scale",)),
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
