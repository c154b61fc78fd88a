"""Whether Triton's interpreter can run this project's kernels here, for tests that run
kernels under ``TRITON_INTERPRET=1`` on CPU tensors.

The probe is a tiny kernel whose loop bound is a value loaded from memory, as the split-K and
split-KV kernels' bounds are. Triton's interpreter before 3.7 cannot run it with NumPy 2 (it
converts the loaded one-element array to a Python int, which NumPy 2 refuses), so on such a
machine (an older pinned torch) those tests are skipped with the reason instead of failing
inside the interpreter. The probe runs once per process, in a child process: the interpreter
is chosen when ``triton.jit`` decorates, and switching it inside one process leaves Triton's
patched language half-applied.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

__all__ = ["PROBE", "interpret_kernels_in", "interpreted_dirs", "mixed_interpreter_warning",
           "triton_interpreter_problem"]

#: The probe's source: a loop whose bound is loaded, run under the interpreter on CPU.
PROBE = """
import torch, triton, triton.language as tl

@triton.jit
def count(bounds, out):
    i = tl.program_id(0)
    total = 0
    for _ in range(0, tl.load(bounds + i), 1):
        total += 1
    tl.store(out + i, total)

bounds = torch.tensor([3, 5], dtype=torch.int32)
out = torch.zeros(2, dtype=torch.int32)
count[(2,)](bounds, out)
assert out.tolist() == [3, 5], out.tolist()
"""


@functools.lru_cache(maxsize=1)
def triton_interpreter_problem(timeout_s: float = 120.0) -> str | None:
    """None when Triton's interpreter runs ``PROBE`` here; otherwise why not (Triton missing,
    or the probe's last error line with the Triton version), for ``pytest.skip``."""
    try:
        import triton
    except ImportError:
        return "triton is not installed"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    try:
        proc = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"Triton {triton.__version__}'s interpreter did not finish a probe kernel " \
               f"in {timeout_s:.0f} s"
    if proc.returncode == 0:
        return None
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    last = lines[-1] if lines else f"exit status {proc.returncode}"
    return (f"Triton {triton.__version__}'s interpreter cannot run a kernel whose loop bound "
            f"is loaded from memory ({last[:200]}); Triton 3.7 or newer can")


_DIRS: list[Path] = []


def interpret_kernels_in(tests_dir: str | os.PathLike[str]) -> None:
    """Run the Triton kernels of the tests under ``tests_dir`` in Triton's interpreter: set
    ``TRITON_INTERPRET=1`` (unless already set) before any kernel module is imported (a
    conftest calls this), and remember the folder (unless the variable was set to ``0``).
    ``triton.jit`` reads the variable once, when it decorates a kernel or helper, so the whole
    process interprets from then on; the ``kernelbay`` pytest plugin warns when the same
    process also collects tests outside such folders, whose compile-for-a-GPU-target checks
    then fail (run each package's tests in its own process, as ``make test`` does)."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ["TRITON_INTERPRET"] in ("", "0"):  # switched off on purpose: nothing to warn
        return
    path = Path(tests_dir).resolve()
    if path not in _DIRS:
        _DIRS.append(path)


def interpreted_dirs() -> tuple[Path, ...]:
    """The folders ``interpret_kernels_in`` registered in this process."""
    return tuple(_DIRS)


def mixed_interpreter_warning(paths: list[str | os.PathLike[str]]) -> str | None:
    """Why tests at ``paths`` may fail here, or None: some folders asked for the interpreter
    and some of ``paths`` lie outside them."""
    if not _DIRS:
        return None
    files = {Path(p).resolve() for p in paths}  # many tests share a file: resolve each once
    outside = sorted({str(f.parent) for f in files
                      if not any(d == f or d in f.parents for d in _DIRS)})
    if not outside:
        return None
    return (f"Triton's interpreter is on for this whole process (TRITON_INTERPRET=1, asked for "
            f"by {', '.join(str(d) for d in _DIRS)}); the tests in {', '.join(outside[:3])}"
            f"{' ...' if len(outside) > 3 else ''} run in the same process, so their kernels "
            "and the helpers they share are interpreted too and checks that compile for a GPU "
            "target fail. Run each package's tests in its own pytest process (make test does).")
