"""Fixtures: the compiled kernels (built once per session into the user cache, or into
``$KERNELBAY_CACHE_DIR``), a registry holding only this plugin, and the FP8 reference."""

from __future__ import annotations

import importlib.metadata as metadata
import os
import sys
from types import ModuleType

import pytest
from kernelbay.plugins import ENTRY_POINT_GROUP, Registry
from kernelbay.policy import Policy

# The helpers are a plain module next to the tests, importable in any import mode.
sys.path.insert(0, os.path.dirname(__file__))

PLUGIN = "cpu_amx"


@pytest.fixture(scope="session")
def ext() -> ModuleType:
    """The compiled extension, built on first use and cached across tests and sessions."""
    from kernelbay_cpu_amx import kernels

    return kernels.extension()


@pytest.fixture
def registry() -> Registry:
    """The core's backends plus this plugin (through its entry point), nothing else."""
    reg = Registry(Policy(plugins=frozenset([PLUGIN])))
    (ep,) = [e for e in metadata.entry_points(group=ENTRY_POINT_GROUP) if e.name == PLUGIN]
    reg.load_entry_point(ep)
    return reg
