"""Every package of ours takes its version from one place: its source's ``__version__``.

A version written both in ``pyproject.toml`` and in the package drifts (it did: four plugins
reported a ``__version__`` older than their wheels), so each pyproject declares the version
dynamic and points hatchling at the file that defines it.
"""

from __future__ import annotations

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYPROJECTS = [os.path.join(ROOT, "core", "pyproject.toml"),
              *sorted(glob.glob(os.path.join(ROOT, "plugins", "*", "pyproject.toml"))),
              os.path.join(ROOT, "examples", "vendor_plugin", "pyproject.toml")]


@pytest.mark.parametrize("pyproject", PYPROJECTS,
                         ids=[os.path.basename(os.path.dirname(p)) for p in PYPROJECTS])
def test_version_comes_from_the_package_source(pyproject: str) -> None:
    with open(pyproject, encoding="utf-8") as f:
        text = f.read()
    project = text.split("[project]", 1)[1].split("\n[", 1)[0]
    assert re.search(r'^dynamic = \["version"\]$', project, re.MULTILINE), (
        f"{pyproject}: [project] must declare dynamic = [\"version\"], not a version of its own")
    assert not re.search(r"^version\s*=", project, re.MULTILINE), pyproject
    path = re.search(r'\[tool\.hatch\.version\]\npath = "([^"]+)"', text)
    assert path, f"{pyproject}: no [tool.hatch.version] path"
    source = os.path.join(os.path.dirname(pyproject), path.group(1))
    with open(source, encoding="utf-8") as f:
        found = re.findall(r'^__version__ = "(\d+\.\d+\.\d+)"$', f.read(), re.MULTILINE)
    assert len(found) == 1, f"{source}: want one __version__ = \"X.Y.Z\", found {found}"
