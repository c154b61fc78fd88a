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

import json
import os
import sys
from typing import Any

from kernelbay.checkpoint import CheckpointFolder
from kernelbay.testing.manifests import file_sha256, tensor_digest, tensor_table


def manifest(path: str, source: str) -> dict[str, Any]:
    """The manifest of the Quark MXFP4 checkpoint at ``path`` quantized from ``source``."""
    folder = CheckpointFolder(path)
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    return {
        "source_sha256": file_sha256(os.path.join(source, "model.safetensors")),
        "tensor_count": len(folder.tensors),
        "tensors": tensor_table(folder, CheckpointFolder(source)),
        "quantization_config": config["quantization_config"],
        "digest": tensor_digest(folder),
    }


if __name__ == "__main__":
    from kernelbay.demo import demo_path

    record = manifest(sys.argv[1], demo_path())
    record = {"recorded_with": "amd-quark 0.13 ModelQuantizer(LLMTemplate.get('deepseek_v3')"
                               ".get_config('mxfp4')) + export_safetensors, transformers "
                               "4.57.6, torch 2.13.0 CPU, on the kernelbay demo model", **record}
    json.dump(record, sys.stdout, indent=1)
    sys.stdout.write("\n")
