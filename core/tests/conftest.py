"""Core test configuration: make the test helpers and fake plugins importable by name."""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(__file__)
# Test helpers (engine_helpers) and the fake plugins import by module name.
sys.path[:0] = [HERE, os.path.join(HERE, "fakeplugins")]
