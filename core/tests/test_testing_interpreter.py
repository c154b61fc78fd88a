"""``kernelbay.testing.interpreter``: the probe that decides whether interpreter tests run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from kernelbay.testing import interpreter


def test_probe_runs_where_triton_is_new_enough() -> None:
    """Here (the CI's Triton) the probe kernel runs under the interpreter; the answer is
    cached for the process."""
    triton = pytest.importorskip("triton")
    interpreter.triton_interpreter_problem.cache_clear()
    major, minor = (int(p) for p in triton.__version__.split(".")[:2])
    problem = interpreter.triton_interpreter_problem()
    if (major, minor) >= (3, 7):
        assert problem is None
    else:  # an older Triton: the reason names it
        assert problem is not None and triton.__version__ in problem
    assert interpreter.triton_interpreter_problem() is problem


def test_a_failing_probe_gives_its_last_error_line(monkeypatch: pytest.MonkeyPatch) -> None:
    triton = pytest.importorskip("triton")
    monkeypatch.setattr(interpreter, "PROBE", "raise ValueError('probe says no')")
    interpreter.triton_interpreter_problem.cache_clear()
    try:
        problem = interpreter.triton_interpreter_problem()
    finally:
        interpreter.triton_interpreter_problem.cache_clear()
    assert problem is not None
    assert "ValueError: probe says no" in problem and triton.__version__ in problem


def test_marker_skips_with_the_reason(tmp_path: object) -> None:
    """A ``triton_interpreter`` test is skipped with the probe's reason where it fails."""
    test = os.path.join(str(tmp_path), "test_marked.py")
    with open(test, "w") as f:
        f.write("import pytest\n\n@pytest.mark.triton_interpreter\n"
                "def test_x():\n    raise AssertionError('must not run')\n")
    # a probe that cannot succeed, seen by the child pytest through this module's PROBE
    conftest = os.path.join(str(tmp_path), "conftest.py")
    with open(conftest, "w") as f:
        f.write("from kernelbay.testing import interpreter\n"
                "interpreter.PROBE = \"raise SystemExit('no interpreter here')\"\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           test], cwd=str(tmp_path), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 skipped" in proc.stdout and "no interpreter here" in proc.stdout


def test_mixed_processes_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder that asked for the interpreter, and tests collected outside it in the same
    process: the warning names both; tests inside it alone, or no such folder: no warning."""
    monkeypatch.setattr(interpreter, "_DIRS", [])
    # set, then removed: monkeypatch restores the process's own state afterwards
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv("TRITON_INTERPRET")
    inside, outside = tmp_path / "mx" / "tests", tmp_path / "nv" / "tests"
    assert interpreter.mixed_interpreter_warning([outside / "test_a.py"]) is None
    interpreter.interpret_kernels_in(inside)
    interpreter.interpret_kernels_in(inside)  # once per folder
    assert os.environ["TRITON_INTERPRET"] == "1"
    assert interpreter.interpreted_dirs() == (inside.resolve(),)
    assert interpreter.mixed_interpreter_warning([inside / "test_a.py",
                                                  inside / "sub" / "test_b.py"]) is None
    message = interpreter.mixed_interpreter_warning([inside / "test_a.py",
                                                     outside / "test_b.py"])
    assert message is not None
    assert str(inside.resolve()) in message and str(outside.resolve()) in message
    assert "own pytest process" in message
