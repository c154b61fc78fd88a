"""``import kernelbay`` and discovery stay light: no torch, triton or transformers."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch", "triton", "transformers", "numpy", "pydantic", "safetensors")


def _modules_after(code: str) -> list[str]:
    probe = code + "\nimport sys, json\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=True, timeout=120)
    return list(json.loads(done.stdout.splitlines()[-1]))


def _heavy(modules: list[str]) -> list[str]:
    return [m for m in modules if m.split(".")[0] in HEAVY]


def test_import_kernelbay_is_light() -> None:
    assert _heavy(_modules_after("import kernelbay")) == []


def test_discovery_and_plugins_command_import_nothing_heavy() -> None:
    code = ("import contextlib, io\nfrom kernelbay.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n    main(['plugins', '--json'])")
    assert _heavy(_modules_after(code)) == []


def test_engine_names_load_on_first_use() -> None:
    code = ("import sys, kernelbay\nassert 'torch' not in sys.modules\n"
            "import kernelbay.engine\nassert kernelbay.LLM is kernelbay.engine.LLM\n"
            "assert kernelbay.SamplingParams is kernelbay.engine.SamplingParams")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
