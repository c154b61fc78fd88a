"""Plain-text tables for the terminal: aligned columns, the last one wrapped."""

from __future__ import annotations

import os
import shutil
import textwrap
from collections.abc import Sequence

__all__ = ["render_table"]


def _terminal_width() -> int:
    if "COLUMNS" in os.environ:
        return max(60, int(os.environ["COLUMNS"]))
    return max(60, shutil.get_terminal_size((120, 24)).columns)


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]],
                 width: int | None = None) -> str:
    """Align ``rows`` under ``headers``; wrap the last column to fit ``width``."""
    total = width or _terminal_width()
    cols = len(headers)
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row[:-1]):
            widths[i] = max(widths[i], len(cell))
    fixed = sum(widths[:-1]) + 2 * (cols - 1)
    last = max(20, total - fixed)
    out = []
    header = "  ".join(h.ljust(widths[i]) for i, h in enumerate(headers[:-1]))
    out.append((header + "  " + headers[-1]).rstrip())
    out.append("  ".join("-" * w for w in widths[:-1]) + "  " + "-" * min(last, 40))
    for row in rows:
        wrapped = textwrap.wrap(row[-1], last) or [""]
        prefix = "  ".join(c.ljust(widths[i]) for i, c in enumerate(row[:-1]))
        out.append((prefix + "  " + wrapped[0]).rstrip())
        pad = " " * (len(prefix) + 2)
        out.extend((pad + more).rstrip() for more in wrapped[1:])
    return "\n".join(out)
