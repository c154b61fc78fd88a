"""In a fresh virtual environment, the core plus any one plugin lists exactly those two.

Each venv sees only the shared third-party packages (torch, pluggy, ...) through a .pth
file, like the CI jobs; our own packages are built and installed fresh. Runs where CI has set
up that shared environment (``KERNELBAY_CI_SHARED_VENV``).
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.environ.get("KERNELBAY_CI_SHARED_VENV", "")
PACKAGES = [*sorted(glob.glob(os.path.join(ROOT, "plugins", "*", "pyproject.toml"))),
            os.path.join(ROOT, "examples", "vendor_plugin", "pyproject.toml")]


def _entry_point(pyproject: str) -> str:
    # The one line under [project.entry-points."kernelbay.plugins"] (no tomllib on 3.10).
    with open(pyproject, encoding="utf-8") as f:
        text = f.read()
    section = text.split('[project.entry-points."kernelbay.plugins"]', 1)[1]
    match = re.search(r"^\s*([A-Za-z0-9_.-]+)\s*=", section, flags=re.MULTILINE)
    assert match, f"{pyproject} declares no kernelbay.plugins entry point"
    return match.group(1)


def _site_packages(python: str) -> str:
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    return subprocess.run([python, "-c", code], check=True, capture_output=True,
                          text=True).stdout.strip()


@pytest.mark.skipif(not SHARED, reason="needs the CI shared environment (scripts/ci.py sets "
                                       "KERNELBAY_CI_SHARED_VENV)")
@pytest.mark.parametrize("pyproject", PACKAGES,
                         ids=[os.path.basename(os.path.dirname(p)) for p in PACKAGES])
def test_core_plus_one_plugin_lists_exactly_two(pyproject: str, tmp_path: object) -> None:
    venv = os.path.join(str(tmp_path), "venv")
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    python = os.path.join(venv, "bin", "python")
    shared_site = _site_packages(os.path.join(SHARED, "bin", "python"))
    with open(os.path.join(_site_packages(python), "_shared.pth"), "w") as f:
        f.write(shared_site + "\n")
    plugin_dir = os.path.dirname(pyproject)
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", "--no-build-isolation",
                    "--no-deps", os.path.join(ROOT, "core"), plugin_dir], check=True,
                   capture_output=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNELBAY_")}
    done = subprocess.run([python, "-m", "kernelbay.cli", "plugins", "--json"], check=True,
                          capture_output=True, text=True, env=env)
    report = json.loads(done.stdout)
    names = sorted(p["name"] for p in report["plugins"])
    assert names == sorted(["core", _entry_point(pyproject)])
    assert all(p["status"] == "loaded" for p in report["plugins"]), report
