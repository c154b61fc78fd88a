"""Streaming a checkpoint's tensors into a built model, with validation and TP sharding.

Every tensor the model expects is found by name (through the format's ``source_name``),
checked for shape and dtype against the safetensors header before any data is read, sliced
to this rank's shard, converted by the format, and copied into its parameter. Anything
missing or unexpected is an error that names the file and the tensor. Only safetensors
(memory-mapped, one shard file at a time) is read; nothing from the checkpoint runs.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from kernelbay.checkpoint.folder import CheckpointFolder
from kernelbay.checkpoint.tensors import TensorInfo
from kernelbay.engine.modules import Linear
from kernelbay.engine.parallel import TensorParallel
from kernelbay.errors import CheckpointError
from kernelbay.layers import CheckpointFormat

__all__ = ["load_weights"]

_FLOATS = ("float32", "bfloat16", "float16", "float64")


@dataclass
class _Target:
    param: torch.Tensor
    shape: tuple[int, ...]
    dtype: str
    shard_dim: int | None
    module: str
    canonical: str
    required: bool = True
    owner: nn.Module | None = None


def _targets(model: nn.Module, handler: CheckpointFormat) -> dict[str, _Target]:
    targets: dict[str, _Target] = {}
    for path, module in model.named_modules():
        if isinstance(module, Linear):
            for canonical, spec in module.method.tensor_specs().items():
                source = handler.source_name(path, canonical)
                targets[source] = _Target(getattr(module, canonical), spec.shape, spec.dtype,
                                          spec.shard_dim, path, canonical, spec.required,
                                          module)
            continue
        for name, param in module.named_parameters(recurse=False):
            full = f"{path}.{name}" if path else name
            targets[full] = _Target(param, tuple(param.shape), str(param.dtype)[6:],
                                    getattr(param, "shard_dim", None), path, name)
    return targets


def _check(name: str, info: TensorInfo, target: _Target, tp: TensorParallel) -> None:
    want = list(target.shape)
    got = list(info.shape)
    if target.shard_dim is not None and tp.size > 1:
        # Shards are ceil-sized; the last rank's is zero-padded (vocabularies that do not
        # divide by the world size). Other layers reject such splits when they are built.
        dim = target.shard_dim
        want[dim] = got[dim] if -(-got[dim] // tp.size) == want[dim] else want[dim] * tp.size
    if got != want:
        raise CheckpointError(info.file, f"shape {got} does not match the expected {want} of "
                              f"{target.module or 'model'}.{target.canonical}", tensor=name)
    same_kind = info.dtype in _FLOATS and target.dtype in _FLOATS
    if info.dtype != target.dtype and not same_kind:
        raise CheckpointError(info.file, f"dtype {info.dtype} does not match the expected "
                              f"{target.dtype}", tensor=name)


def _read(handle: object, name: str, info: TensorInfo, target: _Target,
          tp: TensorParallel) -> torch.Tensor:
    dim = target.shard_dim
    if dim is None or tp.size == 1:
        return handle.get_tensor(name)  # type: ignore[attr-defined, no-any-return]
    chunk = target.shape[dim]
    start = min(tp.rank * chunk, info.shape[dim])
    end = min(start + chunk, info.shape[dim])
    index = tuple(slice(None) if d != dim else slice(start, end) for d in range(len(info.shape)))
    part: torch.Tensor = handle.get_slice(name)[index]  # type: ignore[attr-defined]
    if part.shape[dim] < chunk:  # the last rank's share of a padded vocabulary
        pad = list(part.shape)
        pad[dim] = chunk - part.shape[dim]
        part = torch.cat([part, part.new_zeros(pad)], dim=dim)
    return part


def load_weights(model: nn.Module, folder: CheckpointFolder, handler: CheckpointFormat,
                 tp: TensorParallel, *, ignore: Callable[[str], bool] | None = None,
                 progress: bool | None = None) -> None:
    """Load every parameter of ``model`` from ``folder``, then run each method's post-load
    step. ``ignore`` names checkpoint tensors the model deliberately does not use."""
    from safetensors import safe_open
    from tqdm import tqdm

    targets = _targets(model, handler)
    tensors = folder.tensors
    # An optional tensor the checkpoint lacks leaves no parameter behind: the method sees
    # getattr(layer, name, None) is None.
    for name in [n for n, t in targets.items() if not t.required and n not in tensors]:
        absent = targets.pop(name)
        assert absent.owner is not None
        del absent.owner._parameters[absent.canonical]
    missing = sorted(set(targets) - set(tensors))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(folder.path, f"missing tensor {missing[0]!r}{more}; the "
                              "checkpoint does not match the architecture", tensor=missing[0])
    skip = ignore or (lambda name: False)
    unexpected = sorted(n for n in tensors if n not in targets and not skip(n))
    if unexpected:
        info = tensors[unexpected[0]]
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise CheckpointError(info.file, f"unexpected tensor{more}: no layer of the model reads "
                              "it", tensor=unexpected[0])
    for name, target in targets.items():
        _check(name, tensors[name], target, tp)
    by_file: dict[str, list[str]] = {}
    for name in targets:
        by_file.setdefault(tensors[name].file, []).append(name)
    show = sys.stderr.isatty() if progress is None else progress
    bar = tqdm(total=len(targets), desc="loading", unit="tensor", disable=not show)
    with torch.no_grad():
        for file, names in sorted(by_file.items()):
            with safe_open(file, framework="pt") as handle:
                for name in sorted(names):
                    target = targets[name]
                    value = _read(handle, name, tensors[name], target, tp)
                    value = handler.convert(target.module, target.canonical, value)
                    target.param.copy_(value.to(target.param.dtype))
                    bar.update(1)
    bar.close()
    for module in model.modules():
        if isinstance(module, Linear):
            module.method.process_weights_after_loading(module)

