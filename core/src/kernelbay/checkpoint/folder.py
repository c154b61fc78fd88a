"""A checkpoint folder: its typed config, its quantization config and its tensor headers."""

from __future__ import annotations

import functools
import glob
import os
from typing import Any

from kernelbay.checkpoint.config import (
    HFQuantConfig,
    ModelConfig,
    SafetensorsIndex,
    load_json_model,
)
from kernelbay.checkpoint.tensors import TensorInfo, read_safetensors_header
from kernelbay.errors import CheckpointError
from kernelbay.requests import FormatRequest

__all__ = ["CheckpointFolder"]

INDEX_FILE = "model.safetensors.index.json"


class CheckpointFolder:
    """A local Hugging Face checkpoint folder. Reads JSON and safetensors headers only:
    nothing from the checkpoint is ever executed."""

    def __init__(self, path: str) -> None:
        if not os.path.isdir(path):
            raise CheckpointError(path, "is not a checkpoint folder (expected a directory "
                                  "with config.json and *.safetensors)")
        self.path = os.path.abspath(path)
        self.config = load_json_model(os.path.join(self.path, "config.json"), ModelConfig)
        hf_quant_path = os.path.join(self.path, "hf_quant_config.json")
        self.hf_quant = (load_json_model(hf_quant_path, HFQuantConfig)
                         if os.path.exists(hf_quant_path) else None)

    def file(self, name: str) -> str:
        """Absolute path of a file of this checkpoint."""
        return os.path.join(self.path, name)

    def quantization(self) -> tuple[dict[str, Any] | None, str]:
        """The quantization config and the file it came from (``None`` if unquantized).

        ``config.json``'s ``quantization_config`` wins; else ``hf_quant_config.json``'s
        ``quantization`` (a ModelOpt export) with ``quant_method: "modelopt"``.
        """
        if self.config.quantization_config is not None:
            return dict(self.config.quantization_config), self.file("config.json")
        if self.hf_quant is not None:
            return ({"quant_method": "modelopt", **self.hf_quant.quantization},
                    self.file("hf_quant_config.json"))
        return None, ""

    def format_request(self) -> FormatRequest:
        """The request the checkpoint formats are asked to recognise."""
        config, source = self.quantization()
        extra = self.hf_quant.quantization if self.hf_quant is not None else None
        return FormatRequest.from_config(config, source, extra)

    def shard_files(self) -> list[str]:
        """Absolute paths of the safetensors shards (from the index when there is one)."""
        index_path = self.file(INDEX_FILE)
        if os.path.exists(index_path):
            index = load_json_model(index_path, SafetensorsIndex)
            return sorted({self.file(os.path.normpath(s)) for s in index.weight_map.values()})
        files = sorted(glob.glob(os.path.join(self.path, "*.safetensors")))
        if not files:
            raise CheckpointError(self.path, "holds no *.safetensors file and no "
                                  f"{INDEX_FILE}")
        return files

    @functools.cached_property
    def tensors(self) -> dict[str, TensorInfo]:
        """Every tensor's header entry, checked against the index when there is one."""
        index_path = self.file(INDEX_FILE)
        index = (load_json_model(index_path, SafetensorsIndex)
                 if os.path.exists(index_path) else None)
        found: dict[str, TensorInfo] = {}
        for shard in self.shard_files():
            if not os.path.exists(shard):
                raise CheckpointError(index_path, f"names shard {os.path.basename(shard)!r}, "
                                      "which does not exist")
            for name, info in read_safetensors_header(shard).items():
                if name in found:
                    raise CheckpointError(shard, f"tensor also stored in {found[name].file}",
                                          tensor=name)
                found[name] = info
        if index is not None:
            for name, shard in index.weight_map.items():
                indexed = found.get(name)
                expected = self.file(os.path.normpath(shard))
                if indexed is None or indexed.file != expected:
                    raise CheckpointError(index_path, f"maps the tensor to {shard!r}, but that "
                                          "shard does not hold it", tensor=name)
        return found
