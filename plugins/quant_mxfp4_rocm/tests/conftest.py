"""Make the Quark checkpoint helpers (``quark_checkpoints``) importable in any import mode, and
run the Triton kernels under the interpreter where there is no GPU (set before any kernel
module is imported: ``triton.jit`` reads it when decorating)."""

from __future__ import annotations

import os
import sys

from kernelbay.testing.interpreter import interpret_kernels_in

sys.path.insert(0, os.path.dirname(__file__))


def _has_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


if not _has_gpu():
    interpret_kernels_in(os.path.dirname(__file__))
