"""Where a benchmark's results go: ``results.json`` (the whole record) and ``results.md`` (its
table) in one folder, and the exit status that says whether every measurement was right."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def write_results(out: str | Path, result: dict[str, Any], markdown: str,
                  failures: Sequence[str] = ()) -> int:
    """Write ``result`` as ``out/results.json`` and ``markdown`` as ``out/results.md`` (the
    folder made if needed); print ``failures`` to stderr. Returns 1 when there are any, else
    0, so a wrong result fails the run after what was measured is on disk."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    (folder / "results.md").write_text(markdown, encoding="utf-8")
    if failures:
        print("WRONG RESULTS:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    return 0
