"""Core test configuration: make the fake plugins importable by module name."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "fakeplugins"))
