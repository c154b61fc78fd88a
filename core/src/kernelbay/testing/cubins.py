"""Resource usage and SASS of a compiled cubin, for tests of kernels built by
``kernelbay.cuda_jit`` (registers, stack and local memory, instructions; read without a
GPU)."""

from __future__ import annotations

import glob
import os
import subprocess
import tempfile

__all__ = ["cubin_resources", "cubin_sass"]


def _cuobjdump() -> str | None:
    """Triton's copy of ``cuobjdump`` (None when triton is not installed or lacks it)."""
    try:
        import triton
    except ImportError:
        return None
    found = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia",
                                   "bin", "cuobjdump"))
    return found[0] if found else None


def _dump(cubin: bytes, flag: str) -> str | None:
    tool = _cuobjdump()
    if tool is None:
        return None
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([tool, flag, path], capture_output=True, text=True,
                              check=True).stdout


def cubin_resources(cubin: bytes) -> str | None:
    """``cuobjdump -res-usage`` of ``cubin`` (lines with ``REG:``, ``STACK:``, ``LOCAL:``),
    or None when no ``cuobjdump`` is at hand."""
    return _dump(cubin, "-res-usage")


def cubin_sass(cubin: bytes) -> str | None:
    """``cuobjdump -sass`` of ``cubin`` (one SASS instruction per line), or None when no
    ``cuobjdump`` is at hand."""
    return _dump(cubin, "-sass")
