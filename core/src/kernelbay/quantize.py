"""``kernelbay quantize``: write a checkpoint in a producer's exact format, with the writer a
checkpoint-format plugin offers. The result appears atomically (written to a temporary
folder beside the destination, then renamed) and never overwrites without ``force``."""

from __future__ import annotations

import os
import shutil
import tempfile

from kernelbay.checkpoint.folder import CheckpointFolder
from kernelbay.errors import ConfigError
from kernelbay.kinds import BackendKind
from kernelbay.layers import CheckpointFormat
from kernelbay.plugins import Registry

__all__ = ["available_writers", "quantize_checkpoint"]

#: Files that travel with the weights unchanged.
_SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
               "generation_config.json")


def available_writers(registry: Registry) -> dict[str, tuple[type[CheckpointFormat], str]]:
    """Output format name -> (the format class that writes it, its plugin)."""
    found: dict[str, tuple[type[CheckpointFormat], str]] = {}
    for candidate in registry.candidates(BackendKind.CHECKPOINT_FORMAT):
        cls = candidate.backend
        for name in getattr(cls, "writes", ()):
            found.setdefault(name, (cls, candidate.plugin))  # type: ignore[arg-type]
    return dict(sorted(found.items()))


def quantize_checkpoint(source: str, destination: str, output_format: str, *,
                        registry: Registry, force: bool = False,
                        progress: bool = False) -> str:
    """Write ``source`` (an unquantized checkpoint) to ``destination`` in ``output_format``.

    Raises ``ConfigError`` for an unknown format (listing the installed ones), a source that
    is already quantized, or an existing destination without ``force``. Returns the path.
    """
    writers = available_writers(registry)
    if output_format not in writers:
        valid = sorted(writers) or "none (install a quantization plugin, e.g. "
        raise ConfigError(f"--format {output_format!r} is not written by any installed plugin;"
                          f" available: {valid}" + (
                              "pip install kernelbay-quant-nvfp4)" if not writers else ""))
    folder = CheckpointFolder(source)
    quant, where = folder.quantization()
    if quant is not None:
        raise ConfigError(f"{source} is already quantized ({where} declares quant_method "
                          f"{quant.get('quant_method')!r}); quantize an unquantized checkpoint")
    target = os.path.abspath(destination)
    if os.path.exists(target) and not force:
        raise ConfigError(f"{destination} exists; pass --force to replace it")
    cls, _ = writers[output_format]
    parent = os.path.dirname(target) or "."
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.", dir=parent)
    try:
        cls.write(folder, staging, output_format, progress=progress)
        for name in _SIDE_FILES:
            if os.path.exists(folder.file(name)) and not os.path.exists(
                    os.path.join(staging, name)):
                shutil.copy2(folder.file(name), os.path.join(staging, name))
        if os.path.exists(target):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.old.", dir=parent)
            os.rename(target, os.path.join(old, "previous"))
            os.rename(staging, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target
