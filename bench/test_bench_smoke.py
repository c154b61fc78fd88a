"""Smoke test of the benchmark scripts: they run and write well-formed JSON and markdown.
(Speed is measured by the scripts, never asserted here.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def test_startup_bench_writes_json_and_markdown(tmp_path: object) -> None:
    out = str(tmp_path)
    subprocess.run([sys.executable, os.path.join(HERE, "startup", "run.py"), "--runs", "1",
                    "--out", out], check=True, capture_output=True, timeout=300)
    with open(os.path.join(out, "results.json"), encoding="utf-8") as f:
        result = json.load(f)
    assert [r["case"] for r in result["rows"]][:3] == [
        "python -c pass (baseline)", "import kernelbay", "kernelbay plugins --json"]
    assert "core" in result["plugins"]
    with open(os.path.join(out, "results.md"), encoding="utf-8") as f:
        assert f.read().count("\n|") >= 5
