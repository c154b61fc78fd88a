"""Make the core's test helpers (``engine_helpers``) importable by name."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "core", "tests"))
