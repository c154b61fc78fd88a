"""Smoke test of the benchmark scripts: they run and write well-formed JSON and markdown.
(Speed is measured by the scripts, never asserted here.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def interpreter() -> None:
    """Skips where Triton's interpreter cannot run the kernels these scripts launch (Triton
    before 3.7 cannot loop to a bound loaded from memory), naming the version."""
    pytest.importorskip("triton")
    from kernelbay.testing.interpreter import triton_interpreter_problem

    problem = triton_interpreter_problem()
    if problem:
        pytest.skip(problem)


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


def test_write_results_keeps_the_record_and_fails_on_wrong_results(tmp_path: object,
                                                                    capsys: object) -> None:
    """``report.write_results``: both files written (folder made), exit status 0 without
    failures, 1 with them (named on stderr), the record still on disk."""
    sys.path.insert(0, HERE)
    try:
        from report import write_results
    finally:
        sys.path.remove(HERE)
    out = os.path.join(str(tmp_path), "new", "folder")
    record = {"rows": [{"m": 1, "us": 2.5}]}
    assert write_results(out, record, "| m | us |\n") == 0
    assert write_results(out, record, "| m | us |\n", ["M=1: exceeds the bound"]) == 1
    assert "M=1: exceeds the bound" in capsys.readouterr().err  # type: ignore[attr-defined]
    with open(os.path.join(out, "results.json"), encoding="utf-8") as f:
        assert json.load(f) == record
    with open(os.path.join(out, "results.md"), encoding="utf-8") as f:
        assert f.read() == "| m | us |\n"


@pytest.mark.parametrize(("script", "timed"), [("nvfp4", "grouped_graph_us"),
                                              ("mxfp4", "per_expert_us")])
@pytest.mark.usefixtures("interpreter")
def test_moe_bench_runs_in_the_interpreter(tmp_path: object, script: str, timed: str) -> None:
    """bench/{nvfp4,mxfp4}/moe.py end to end on tiny shapes in Triton's interpreter (their
    correctness checks included: a wrong grouped or per-expert result exits 1)."""
    out = str(tmp_path)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    subprocess.run([sys.executable, os.path.join(HERE, script, "moe.py"), "--device", "cpu",
                    "--experts", "4", "--top-k", "2", "--hidden", "256", "--inter", "128",
                    "--tokens", "1,5", "--out", out], check=True, capture_output=True,
                   timeout=300, env=env)
    with open(os.path.join(out, "results.json"), encoding="utf-8") as f:
        result = json.load(f)
    assert [r["tokens"] for r in result["rows"]] == [1, 5]
    assert not result["failures"] and all(r[timed] > 0 for r in result["rows"])


@pytest.mark.usefixtures("interpreter")
def test_routing_bench_runs_in_the_interpreter(tmp_path: object) -> None:
    """bench/moe_routing/run.py end to end on tiny routings in Triton's interpreter (every way
    checked against the tensor operations: a wrong block exits 1)."""
    out = str(tmp_path)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    subprocess.run([sys.executable, os.path.join(HERE, "moe_routing", "run.py"), "--device",
                    "cpu", "--slots", "8,72", "--experts", "16", "--out", out], check=True,
                   capture_output=True, timeout=600, env=env)
    with open(os.path.join(out, "results.json"), encoding="utf-8") as f:
        result = json.load(f)
    assert [r["slots"] for r in result["rows"]] == [8, 72] and not result["failures"]
    assert "small_w1_us" in result["rows"][0] and "small_w1_us" not in result["rows"][1]
    # 72 slots in chunks of 64: the multi-program routing's two chunks were checked and timed
    assert "multi_c64_w4_us" in result["rows"][1]


@pytest.mark.usefixtures("interpreter")
def test_slot_sum_release_bench_runs_in_the_interpreter(tmp_path: object) -> None:
    """bench/moe_routing/slot_sum_release.py end to end on a tiny layer in Triton's interpreter
    (each variant's sum checked bit for bit against the tensor sum: a wrong one exits 1)."""
    out = str(tmp_path)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    subprocess.run([sys.executable, os.path.join(HERE, "moe_routing", "slot_sum_release.py"),
                    "--device", "cpu", "--tokens", "2", "--hidden", "64", "--next-n", "32",
                    "--out", out], check=True, capture_output=True, timeout=600, env=env)
    with open(os.path.join(out, "results.json"), encoding="utf-8") as f:
        result = json.load(f)
    (row,) = result["rows"]
    assert row["tokens"] == 2 and not result["failures"]
    assert all(f"self_{v}_us" in row for v in ("start", "loads", "end", "plain"))
    with open(os.path.join(out, "results.md"), encoding="utf-8") as f:
        assert "| 2 | sums back to back |" in f.read()
