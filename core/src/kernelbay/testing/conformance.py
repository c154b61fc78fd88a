"""A conformance suite each plugin runs over its own classes.

Subclass ``PluginConformance`` in a test module and set ``plugin`` to the entry-point name::

    from kernelbay.testing import PluginConformance

    class TestConformance(PluginConformance):
        plugin = "quant_nvfp4"

Every test asks only the plugin's own classes, on described (never probed) devices.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import re
import subprocess
import sys
from typing import Any, ClassVar

from kernelbay._hookcall import api_compatible
from kernelbay._version import PLUGIN_API_VERSION
from kernelbay.backend import Backend
from kernelbay.kinds import BackendKind
from kernelbay.plugins import ENTRY_POINT_GROUP, PluginStatus, Registry
from kernelbay.policy import Policy
from kernelbay.select import ask
from kernelbay.testing.samples import sample_devices, sample_requests
from kernelbay.verdict import Verdict

__all__ = ["PluginConformance"]

_DISCOVERY_PROBE = r"""
import importlib.metadata as m, json, sys
eps = [e for e in m.entry_points(group={group!r}) if e.name == {name!r}]
from kernelbay.plugins import Registry
from kernelbay.policy import Policy
registry = Registry(Policy(plugins=frozenset([{name!r}])))
for ep in eps:
    registry.load_entry_point(ep)
mods = {{n: getattr(sys.modules[n], "__file__", None) or "" for n in list(sys.modules)}}
print(json.dumps(mods))
"""


class PluginConformance:
    """Pytest test class: checks one installed plugin against the plugin contract."""

    #: Entry-point name of the plugin under test (group ``kernelbay.plugins``).
    plugin: ClassVar[str] = ""
    #: Extra requests to ask the plugin's classes about, per kind.
    extra_requests: ClassVar[dict[BackendKind, list[object]]] = {}
    #: Module prefixes that must not be imported by discovering the plugin.
    forbidden_at_discovery: ClassVar[tuple[str, ...]] = ("triton", "transformers.models",
                                                         "torch")

    # -- helpers ---------------------------------------------------------------------------

    def _entry_point(self) -> metadata.EntryPoint:
        assert self.plugin, f"{type(self).__name__}.plugin must name the plugin under test"
        found = [e for e in metadata.entry_points(group=ENTRY_POINT_GROUP)
                 if e.name == self.plugin]
        assert found, (f"no entry point named {self.plugin!r} in group {ENTRY_POINT_GROUP!r}; "
                       "is the plugin installed?")
        return found[0]

    def _registry(self) -> Registry:
        registry = Registry(Policy(plugins=frozenset([self.plugin])))
        registry.load_entry_point(self._entry_point())
        return registry

    def _classes(self) -> list[tuple[BackendKind, type[Backend[Any]]]]:
        registry = self._registry()
        return [(kind, c.backend) for kind in BackendKind for c in registry.candidates(kind)
                if c.plugin == self.plugin]

    # -- tests -----------------------------------------------------------------------------

    def test_discoverable_through_entry_point(self) -> None:
        record = self._registry().record(self.plugin)
        assert record.status is PluginStatus.LOADED, (
            f"plugin {self.plugin!r} is {record.status.value}: {record.reason}")
        assert record.distribution, "the entry point must belong to an installed distribution"
        assert any(names for _, names in record.offers), f"{self.plugin!r} offers no backend"

    def test_declares_compatible_api(self) -> None:
        module = self._entry_point().load()
        declared = getattr(module, "KERNELBAY_PLUGIN_API", None)
        assert api_compatible(declared, PLUGIN_API_VERSION) is None, declared

    def test_classes_carry_the_contract(self) -> None:
        for kind, cls in self._classes():
            assert cls.__dict__.get("name"), f"{cls.__qualname__} must set its own name"
            assert isinstance(cls.priority, int)
            assert api_compatible(cls.api_version, PLUGIN_API_VERSION) is None
            assert cls.summary.strip(), f"{cls.__qualname__} needs a one-line summary"
            assert (cls.__doc__ or "").strip(), f"{cls.__qualname__} needs a docstring"
            assert cls.kind is kind

    def test_verdicts_are_well_formed_and_deterministic(self) -> None:
        devices = sample_devices()
        for kind, cls in self._classes():
            requests = sample_requests(kind) + list(self.extra_requests.get(kind, []))
            for request in requests:
                for device in devices:
                    first = cls.can_implement(request, device)
                    assert isinstance(first, Verdict), (cls.name, request, device)
                    assert first == cls.can_implement(request, device), (
                        f"{cls.name} is not deterministic for {request} on {device}")
                    assert first == ask(cls, request, device, strict=True)
                    if not first.accepted:
                        assert len(first.reason.split()) >= 3, (
                            f"{cls.name}: rejection reason {first.reason!r} is not a sentence")
                        assert not first.reason.startswith("can_implement raised")

    def test_rejection_reasons_name_values(self) -> None:
        # A reason states what was needed and what was found: it carries at least one value.
        for kind, cls in self._classes():
            for request in sample_requests(kind):
                for device in sample_devices():
                    verdict = cls.can_implement(request, device)
                    if not verdict.accepted:
                        assert re.search(r"\d|'|\"", verdict.reason), (
                            f"{cls.name}: reason {verdict.reason!r} names no value")

    def test_no_heavy_import_during_discovery(self) -> None:
        code = _DISCOVERY_PROBE.format(group=ENTRY_POINT_GROUP, name=self.plugin)
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              check=False, timeout=120)
        assert done.returncode == 0, done.stderr
        modules: dict[str, str] = json.loads(done.stdout.strip().splitlines()[-1])
        heavy = sorted(n for n in modules
                       if any(n == p or n.startswith(p + ".") for p in self.forbidden_at_discovery))
        assert not heavy, f"discovering {self.plugin!r} imported {heavy[:10]}"
        package = self._entry_point().value.split(":")[0].split(".")[0]
        compiled = sorted(n for n, f in modules.items()
                          if n.split(".")[0] == package and f.endswith((".so", ".pyd")))
        assert not compiled, f"discovering {self.plugin!r} loaded compiled modules {compiled}"
