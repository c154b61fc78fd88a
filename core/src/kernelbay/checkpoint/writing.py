"""Writing checkpoints the way ``save_pretrained`` lays them out, for the format writers:
lazy reads of the source, shards of a bounded size, and the index when there are several."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kernelbay.checkpoint.tensors import TensorInfo

if TYPE_CHECKING:
    import torch

__all__ = ["SourceTensors", "plan_shards", "write_shards"]


class SourceTensors:
    """Lazy reads of a checkpoint's tensors, one open safetensors handle per file."""

    def __init__(self, tensors: Mapping[str, TensorInfo]) -> None:
        self.tensors = tensors
        self._handles: dict[str, Any] = {}

    def __call__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        file = self.tensors[name].file
        if file not in self._handles:
            self._handles[file] = safe_open(file, framework="pt")
        tensor: torch.Tensor = self._handles[file].get_tensor(name)
        return tensor


def plan_shards(units: Sequence[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Split ``(unit, bytes)`` in order into shards of at most ``max_bytes`` (a unit larger
    than that gets a shard of its own), as ``save_pretrained`` does."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in units:
        if shards[-1] and used + size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def write_shards(destination: str, units: Sequence[tuple[str, int]],
                 produce: Callable[[str], Mapping[str, torch.Tensor]], *, max_bytes: int,
                 progress: bool = False, index_sort_keys: bool = False) -> dict[str, str]:
    """Write ``model.safetensors`` (or numbered shards and ``model.safetensors.index.json``)
    into ``destination``. ``units`` are (name, estimated bytes) in file order; ``produce(name)``
    returns the tensors written for that unit (a quantized weight brings its scales).
    Returns the weight map (tensor name -> file)."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    shards = plan_shards(units, max_bytes)
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    bar = tqdm(total=len(units), desc="writing", unit="tensor", disable=not progress)
    weight_map: dict[str, str] = {}
    for file, names in zip(files, shards, strict=True):
        out: dict[str, torch.Tensor] = {}
        for name in names:
            out.update(produce(name))
            bar.update(1)
        weight_map.update(dict.fromkeys(out, file))
        save_file(out, os.path.join(destination, file), metadata={"format": "pt"})
    bar.close()
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(size for _, size in units)},
                 "weight_map": dict(sorted(weight_map.items()))}
        with open(os.path.join(destination, "model.safetensors.index.json"), "w",
                  encoding="utf-8") as f:
            json.dump(index, f, indent=2, sort_keys=index_sort_keys)
    return weight_map
