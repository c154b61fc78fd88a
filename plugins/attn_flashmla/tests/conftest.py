"""Make the test helpers (``_bounds``) importable by name under pytest's importlib mode."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
