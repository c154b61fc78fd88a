"""pytest plugin for plugin authors: fixtures and hardware markers.

Fixtures: ``kb_registry`` (a fresh registry with the core's backends and no entry points),
``kb_device`` (describe a device from a spec string), ``kb_register`` (register a plugin
inline; unregistered after the test). Markers: ``gpu`` (needs CUDA),
``cpu_isa("amx_bf16", ...)`` (needs those CPU flags) and ``triton_interpreter`` (runs kernels
under Triton's interpreter: needs one that can, ``kernelbay.testing.interpreter``); tests
whose hardware or tools are absent are skipped with the reason, never silently passed. A
process that collects tests both inside and outside folders whose conftest asked for Triton's
interpreter (``kernelbay.testing.interpreter.interpret_kernels_in``) gets a warning naming them:
the interpreter is chosen once per process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kernelbay.device import DeviceCapability, parse_device
from kernelbay.plugins import PluginRecord, Registry
from kernelbay.policy import Policy


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped elsewhere)")
    config.addinivalue_line("markers",
                            "cpu_isa(*flags): needs these CPU ISA flags (skipped elsewhere)")
    config.addinivalue_line("markers", "triton_interpreter: runs kernels under Triton's "
                            "interpreter (skipped where it cannot)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from kernelbay.testing.interpreter import mixed_interpreter_warning

    mixed = mixed_interpreter_warning([item.path for item in items])
    if mixed:
        config.issue_config_time_warning(pytest.PytestWarning(mixed), stacklevel=2)
    gpu_items = [i for i in items if i.get_closest_marker("gpu")]
    if gpu_items:
        import torch

        if not torch.cuda.is_available():
            skip = pytest.mark.skip(reason="needs a CUDA device; none here")
            for item in gpu_items:
                item.add_marker(skip)
    isa_items = [i for i in items if i.get_closest_marker("cpu_isa")]
    if isa_items:
        from kernelbay.device import _read_cpu_flags

        flags = _read_cpu_flags()
        for item in isa_items:
            marker = item.get_closest_marker("cpu_isa")
            assert marker is not None
            missing = [f for f in marker.args if f not in flags]
            if missing:
                item.add_marker(pytest.mark.skip(reason=f"needs CPU flags {missing}; "
                                                 f"this CPU has {sorted(flags)}"))
    interpreted = [i for i in items if i.get_closest_marker("triton_interpreter")]
    if interpreted:
        from kernelbay.testing.interpreter import triton_interpreter_problem

        problem = triton_interpreter_problem()
        if problem is not None:
            for item in interpreted:
                item.add_marker(pytest.mark.skip(reason=problem))


@pytest.fixture
def kb_registry() -> Registry:
    """A fresh registry: the core's reference backends, no entry points loaded."""
    return Registry(Policy(plugins=frozenset()))


@pytest.fixture
def kb_device() -> Callable[[str], DeviceCapability]:
    """Describe a device from a spec string (``sm_90``, ``gfx950``, ``cpu+amx``)."""
    return parse_device


@pytest.fixture
def kb_register(kb_registry: Registry) -> Iterator[Callable[..., PluginRecord]]:
    """Register a plugin object inline into ``kb_registry``; unregistered after the test."""
    names: list[str] = []

    def register(plugin: object, name: str = "inline", **kwargs: object) -> PluginRecord:
        names.append(name)
        return kb_registry.register(plugin, name, **kwargs)  # type: ignore[arg-type]

    yield register
    for name in names:
        kb_registry.unregister(name)
