"""``kernelbay quantize SRC DST --format F``, ``kernelbay quantize --list``, and the cached
quantized demo of ``run``."""

from __future__ import annotations

import hashlib
import os
import sys

from kernelbay._table import render_table
from kernelbay.cache import cache_dir
from kernelbay.plugins import Registry
from kernelbay.policy import Policy

__all__ = ["cached_quantized", "run_quantize", "run_quantize_list", "writer_rows"]


def run_quantize(policy: Policy, source: str, destination: str, output_format: str, *,
                 force: bool) -> int:
    """Write ``source`` in ``output_format`` to ``destination`` with a progress bar."""
    from kernelbay.quantize import quantize_checkpoint

    registry = Registry.discover(policy)
    path = quantize_checkpoint(source, destination, output_format, registry=registry,
                               force=force, progress=sys.stderr.isatty())
    print(f"wrote {output_format} checkpoint to {path}")
    return 0


def writer_rows(registry: Registry) -> list[list[str]]:
    """One row per output format the installed plugins write: the format, its plugin, the
    plugin's version, and the checkpoint format that writes it (name: summary)."""
    from kernelbay.quantize import available_writers

    rows = []
    for output_format, (cls, plugin) in available_writers(registry).items():
        rows.append([output_format, plugin, registry.record(plugin).version or "-",
                     f"{cls.name}: {cls.summary}" if cls.summary else cls.name])
    return rows


def run_quantize_list(policy: Policy) -> int:
    """Print the output formats ``kernelbay quantize --format`` accepts here."""
    rows = writer_rows(Registry.discover(policy))
    if not rows:
        print("no installed plugin writes a checkpoint format; install one, e.g. "
              "pip install kernelbay-quant-nvfp4 (modelopt-nvfp4)")
        return 0
    print(render_table(["format", "plugin", "version", "written by"], rows))
    return 0


def cached_quantized(policy: Policy, source: str, output_format: str) -> str:
    """``source`` quantized to ``output_format``, made once and kept in the user cache
    (keyed by the source weights and the writing plugin's version)."""
    from kernelbay.quantize import available_writers, quantize_checkpoint

    registry = Registry.discover(policy)
    writers = available_writers(registry)
    digest = hashlib.sha256()
    for name in sorted(os.listdir(source)):
        if name.endswith(".safetensors"):
            with open(os.path.join(source, name), "rb") as f:
                digest.update(f.read())
    plugin = writers[output_format][1] if output_format in writers else "-"
    version = registry.record(plugin).version if plugin != "-" else "-"
    key = f"{output_format}-{digest.hexdigest()[:12]}-{plugin}-{version}"
    target = str(cache_dir("quantized", key))
    if not os.path.isdir(target):
        print(f"quantizing {source} to {output_format} (once; cached in {target})",
              file=sys.stderr)
        quantize_checkpoint(source, target, output_format, registry=registry,
                            progress=sys.stderr.isatty())
    return target
