"""Run the Triton kernels in the interpreter on machines without CUDA (set before any test
module imports triton), and make the core's test helpers importable by name."""

from __future__ import annotations

import os
import sys

import torch
from kernelbay.testing.interpreter import interpret_kernels_in

if not torch.cuda.is_available():
    interpret_kernels_in(os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "core", "tests"))
