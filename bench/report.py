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


def row_line(row: dict[str, Any]) -> str:
    """One measured row as a progress line: ``key value`` pairs, floats to one decimal."""
    return ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                     for k, v in row.items())


def run_record(benchmark: str, device: str, **fields: Any) -> dict[str, Any]:
    """The head of a results record: what was measured, on which device (``cuda``: the GPU's
    name; else the interpreter check), when, with which torch and triton, then ``fields``."""
    import datetime

    import torch
    import triton

    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu (Triton interpreter)"
    return {"benchmark": benchmark, "device": name,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "triton": triton.__version__, **fields}
