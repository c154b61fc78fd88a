"""Plugin discovery and the registry of candidates.

Plugins are found through entry points in the group ``kernelbay.plugins`` and loaded one at
a time. A plugin that fails to import, targets an incompatible API, reuses a backend name or
returns garbage is recorded with a status and a one-line reason; the rest keeps working.
Under ``Policy.strict`` each of these raises ``PluginError`` instead.
"""

from __future__ import annotations

import functools
import importlib.metadata as metadata
import traceback
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, final

import pluggy

from kernelbay._hookcall import Offers, add_hookspecs, api_compatible, collect_offers, unknown_hooks
from kernelbay._version import PLUGIN_API_VERSION, __version__
from kernelbay.backend import Backend
from kernelbay.device import DeviceCapability, parse_device, probe_device
from kernelbay.errors import ConfigError, PluginError
from kernelbay.hookspecs import PROJECT_NAME
from kernelbay.kinds import BackendKind
from kernelbay.layers import DeviceProbe
from kernelbay.policy import Policy
from kernelbay.trace import CandidateStatus, TraceLine

__all__ = [
    "ENTRY_POINT_GROUP",
    "Candidate",
    "PluginRecord",
    "PluginStatus",
    "Registry",
    "get_registry",
]

ENTRY_POINT_GROUP = "kernelbay.plugins"
CORE_PLUGIN = "core"
API_ATTRIBUTE = "KERNELBAY_PLUGIN_API"


class PluginStatus(str, Enum):
    """A plugin's state after discovery."""

    LOADED = "loaded"
    PARTIAL = "partial"
    FAILED = "failed"
    INCOMPATIBLE = "incompatible"
    DISABLED = "disabled"
    NOT_ALLOWED = "not allowed"


@final
@dataclass(frozen=True)
class PluginRecord:
    """One plugin as discovery saw it: where it came from, its status, and what it offers."""

    name: str
    distribution: str | None
    version: str | None
    api_version: str | None
    status: PluginStatus
    reason: str = ""
    offers: tuple[tuple[BackendKind, tuple[str, ...]], ...] = ()
    problems: tuple[str, ...] = ()
    builtin: bool = False
    detail: str = field(default="", compare=False, repr=False)

    def offers_of(self, kind: BackendKind) -> tuple[str, ...]:
        """Backend names this plugin offers for ``kind``."""
        return dict(self.offers).get(kind, ())

    def as_dict(self) -> dict[str, object]:
        """JSON-ready form (stable keys)."""
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "api_version": self.api_version,
            "status": self.status.value,
            "reason": self.reason,
            "builtin": self.builtin,
            "offers": {k.value: list(v) for k, v in self.offers},
            "problems": list(self.problems),
        }


@final
@dataclass(frozen=True)
class Candidate:
    """A backend class and the plugin that offered it."""

    backend: type[Backend[Any]]
    plugin: str

    @property
    def name(self) -> str:
        """The backend's unique name."""
        return self.backend.name


@dataclass
class _Entry:
    name: str
    obj: object
    distribution: str | None
    version: str | None
    api_version: str | None
    builtin: bool
    offers: Offers


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


class Registry:
    """The plugins loaded under one policy, and the candidates they offer per kind.

    ``Registry.discover(policy)`` loads entry points; tests build ``Registry(policy)`` and
    ``register`` plugins inline. Decisions made by ``kernelbay.select`` are cached here.
    """

    def __init__(self, policy: Policy | None = None, *, builtin: bool = True) -> None:
        self.policy = policy if policy is not None else Policy()
        self._pm = pluggy.PluginManager(PROJECT_NAME)
        add_hookspecs(self._pm)
        self._entries: dict[str, _Entry] = {}
        self._records: dict[str, PluginRecord] = {}
        self._candidates: dict[BackendKind, list[Candidate]] = {}
        self._problems: dict[BackendKind | None, list[TraceLine]] = {}
        self.notes: list[str] = []
        self.decisions: dict[object, object] = {}
        self._device: DeviceCapability | None = None
        if builtin:
            from kernelbay import _builtin

            self.register(_builtin, CORE_PLUGIN, distribution="kernelbay", version=__version__,
                          builtin=True)
        self._rebuild()

    # -- discovery -------------------------------------------------------------------------

    @classmethod
    def discover(cls, policy: Policy | None = None,
                 entry_points: Iterable[metadata.EntryPoint] | None = None) -> Registry:
        """Load every installed plugin the policy allows, one at a time, sorted by name."""
        registry = cls(policy)
        eps = list(entry_points if entry_points is not None
                   else metadata.entry_points(group=ENTRY_POINT_GROUP))
        seen: dict[str, metadata.EntryPoint] = {}
        for ep in sorted(eps, key=lambda e: (e.name, e.value)):
            if ep.name in seen or ep.name == CORE_PLUGIN:
                registry._fail_duplicate_entry_point(ep, seen.get(ep.name))
                continue
            seen[ep.name] = ep
            registry.load_entry_point(ep)
        allow = registry.policy.plugins
        if allow is not None:
            for name in sorted(allow - set(seen) - {CORE_PLUGIN}):
                note = (f"KERNELBAY_PLUGINS names {name!r}, which matches no installed plugin; "
                        f"installed: {sorted(seen) or 'none'}")
                if registry.policy.strict:
                    raise ConfigError(note)
                registry.notes.append(note)
        return registry

    def _fail_duplicate_entry_point(self, ep: metadata.EntryPoint,
                                    first: metadata.EntryPoint | None) -> None:
        dist = _dist_of(ep)
        other = (f"distribution {_dist_of(first)[0]!r}" if first is not None
                 else "the core's built-in plugin")
        reason = f"plugin name {ep.name!r} is already used by {other}"
        if self.policy.strict:
            raise PluginError(ep.name, reason)
        key = f"{ep.name} ({dist[0]})"
        self._records[key] = PluginRecord(key, dist[0], dist[1], None, PluginStatus.FAILED,
                                          reason)
        self._rebuild()

    def load_entry_point(self, ep: metadata.EntryPoint) -> PluginRecord:
        """Import one entry point's plugin (unless the policy excludes it) and register it."""
        dist, version = _dist_of(ep)
        policy = self.policy
        if policy.plugins is not None and ep.name not in policy.plugins:
            return self._record_only(ep.name, dist, version, PluginStatus.NOT_ALLOWED,
                                     "not in KERNELBAY_PLUGINS")
        if ep.name in policy.disable:
            return self._record_only(ep.name, dist, version, PluginStatus.DISABLED,
                                     "named in KERNELBAY_DISABLE")
        try:
            plugin = ep.load()
        except Exception as exc:
            if policy.strict:
                raise PluginError(ep.name, f"failed to import {ep.value!r}: "
                                  f"{_one_line(exc)}") from exc
            return self._record_only(ep.name, dist, version, PluginStatus.FAILED,
                                     f"import of {ep.value!r} raised {_one_line(exc)}",
                                     traceback.format_exc())
        return self.register(plugin, ep.name, distribution=dist, version=version)

    def _record_only(self, name: str, dist: str | None, version: str | None,
                     status: PluginStatus, reason: str, detail: str = "") -> PluginRecord:
        record = PluginRecord(name, dist, version, None, status, reason, detail=detail)
        self._records[name] = record
        self._rebuild()
        return record

    # -- registration ----------------------------------------------------------------------

    def register(self, plugin: object, name: str, *, distribution: str | None = None,
                 version: str | None = None, builtin: bool = False) -> PluginRecord:
        """Register a plugin object (a module or any object with hook implementations).

        Its hooks are called once, in isolation; what they return is validated. Returns the
        plugin's record; raises ``PluginError`` in strict mode when anything is wrong.
        """
        if name in self._entries or name in self._records:
            reason = f"plugin name {name!r} is already registered"
            if self.policy.strict:
                raise PluginError(name, reason)
            return PluginRecord(name, distribution, version, None, PluginStatus.FAILED, reason)
        api = getattr(plugin, API_ATTRIBUTE, None) if not builtin else PLUGIN_API_VERSION
        why = (f"does not declare {API_ATTRIBUTE}" if api is None
               else api_compatible(api, PLUGIN_API_VERSION))
        if why is not None:
            if self.policy.strict:
                raise PluginError(name, why)
            return self._record_only(name, distribution, version, PluginStatus.INCOMPATIBLE,
                                     why)
        try:
            self._pm.register(plugin, name=name)
        except Exception as exc:
            if self.policy.strict:
                raise PluginError(name, f"hook validation failed: {_one_line(exc)}") from exc
            return self._record_only(name, distribution, version, PluginStatus.FAILED,
                                     f"hook validation failed: {_one_line(exc)}")
        offers = collect_offers(self._pm, plugin, PLUGIN_API_VERSION)
        for hook in unknown_hooks(self._pm, plugin):
            offers.problems.append((None, "", "failed", f"implements unknown hook {hook!r}"))
        if offers.problems and self.policy.strict:
            self._pm.unregister(plugin)
            raise PluginError(name, "; ".join(p[3] for p in offers.problems))
        self._entries[name] = _Entry(name, plugin, distribution, version, str(api), builtin,
                                     offers)
        self._rebuild()
        return self._records[name]

    def unregister(self, name: str) -> None:
        """Remove a plugin registered earlier (tests register and unregister inline)."""
        entry = self._entries.pop(name, None)
        if entry is not None:
            self._pm.unregister(entry.obj)
        self._records.pop(name, None)
        self._rebuild()

    def _rebuild(self) -> None:
        """Recompute candidates, name conflicts and records from the registered entries.

        Conflicts are decided from the whole set, sorted by plugin name, so the outcome never
        depends on install or registration order: a name the core uses stays the core's;
        a name two plugins use is excluded from both.
        """
        self.decisions.clear()
        owners: dict[tuple[BackendKind, str], list[_Entry]] = {}
        for entry in sorted(self._entries.values(), key=lambda e: (not e.builtin, e.name)):
            for kind, classes in entry.offers.classes.items():
                for cls in classes:
                    owners.setdefault((kind, cls.name), []).append(entry)
        candidates: dict[BackendKind, list[Candidate]] = {k: [] for k in BackendKind}
        problems: dict[BackendKind | None, list[TraceLine]] = {}
        conflicts: dict[str, list[str]] = {}
        for (kind, backend_name), entries in owners.items():
            builtin = [e for e in entries if e.builtin]
            winners = builtin[:1] if builtin else (entries if len(entries) == 1 else [])
            for entry in entries:
                cls = next(c for c in entry.offers.classes[kind] if c.name == backend_name)
                if entry in winners:
                    candidates[kind].append(Candidate(cls, entry.name))
                    continue
                others = ", ".join(f"{e.name!r} ({e.distribution} {e.version})"
                                   for e in entries if e is not entry)
                reason = f"backend name {backend_name!r} is also registered by plugin {others}"
                if self.policy.strict:
                    raise PluginError(entry.name, reason)
                problems.setdefault(kind, []).append(TraceLine(
                    backend_name, entry.name, CandidateStatus.BLOCKED, reason, cls.priority))
                conflicts.setdefault(entry.name, []).append(reason)
        for entry in self._entries.values():
            for problem_kind, backend_name, status, reason in entry.offers.problems:
                trace_status = (CandidateStatus.INCOMPATIBLE if status == "incompatible"
                                else CandidateStatus.FAILED)
                problems.setdefault(problem_kind, []).append(TraceLine(
                    backend_name or f"<{entry.name}>", entry.name, trace_status, reason))
        for record in self._records.values():
            if record.status in (PluginStatus.FAILED, PluginStatus.INCOMPATIBLE):
                status = (CandidateStatus.INCOMPATIBLE
                          if record.status is PluginStatus.INCOMPATIBLE
                          else CandidateStatus.FAILED)
                problems.setdefault(None, []).append(TraceLine(
                    f"<{record.name}>", record.name, status, record.reason))
        for entry in self._entries.values():
            issues = [p[3] for p in entry.offers.problems] + conflicts.get(entry.name, [])
            offered = tuple((k, tuple(sorted(c.name for c in classes)))
                            for k, classes in entry.offers.classes.items() if classes)
            self._records[entry.name] = PluginRecord(
                entry.name, entry.distribution, entry.version, entry.api_version,
                PluginStatus.PARTIAL if issues else PluginStatus.LOADED,
                issues[0] if issues else "", offered, tuple(issues), entry.builtin)
        for kind in candidates:
            candidates[kind].sort(key=lambda c: c.name)
        self._candidates = candidates
        self._problems = problems

    # -- queries ---------------------------------------------------------------------------

    @property
    def records(self) -> tuple[PluginRecord, ...]:
        """Every plugin seen, the core first, then by name."""
        return tuple(sorted(self._records.values(), key=lambda r: (not r.builtin, r.name)))

    def record(self, name: str) -> PluginRecord:
        """The record of one plugin; ``KeyError`` lists the known names."""
        try:
            return self._records[name]
        except KeyError:
            raise KeyError(f"no plugin named {name!r}; known: {sorted(self._records)}") from None

    def candidates(self, kind: BackendKind) -> tuple[Candidate, ...]:
        """Valid candidates of ``kind``, sorted by backend name."""
        return tuple(self._candidates[kind])

    def problems(self, kind: BackendKind) -> tuple[TraceLine, ...]:
        """Trace lines for plugins and backends of ``kind`` that cannot be candidates."""
        lines = self._problems.get(kind, []) + self._problems.get(None, [])
        return tuple(sorted(lines, key=lambda t: (t.plugin, t.backend)))

    def device_probes(self) -> tuple[tuple[str, DeviceProbe], ...]:
        """Vendor device probes, by plugin name."""
        return tuple((e.name, p) for e in sorted(self._entries.values(), key=lambda e: e.name)
                     for p in e.offers.probes)

    def device(self) -> DeviceCapability:
        """The device decisions are made for: described by the policy, else probed (vendor
        probes first, then the core's). Cached."""
        if self._device is None:
            self._device = self._resolve_device()
        return self._device

    def _resolve_device(self) -> DeviceCapability:
        spec = self.policy.device
        probes = self.device_probes()
        if spec:
            for plugin, probe in probes:
                try:
                    found = probe.parse(spec)
                except Exception as exc:
                    if self.policy.strict:
                        raise PluginError(plugin, f"device probe {probe.name!r} raised "
                                          f"{_one_line(exc)} parsing {spec!r}") from exc
                    self.notes.append(f"device probe {probe.name!r} of plugin {plugin!r} "
                                      f"raised {_one_line(exc)} parsing {spec!r}")
                    continue
                if found is not None:
                    return found
            return parse_device(spec)
        for plugin, probe in probes:
            try:
                found = probe.probe()
            except Exception as exc:
                if self.policy.strict:
                    raise PluginError(plugin, f"device probe {probe.name!r} raised "
                                      f"{_one_line(exc)}") from exc
                self.notes.append(f"device probe {probe.name!r} of plugin {plugin!r} raised "
                                  f"{_one_line(exc)}")
                continue
            if found is not None:
                return found
        return probe_device()


def _dist_of(ep: metadata.EntryPoint | None) -> tuple[str | None, str | None]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return None, None
    return dist.metadata["Name"], dist.version


@functools.lru_cache(maxsize=8)
def get_registry(policy: Policy | None = None) -> Registry:
    """The process-wide registry for ``policy`` (default: read from the environment once)."""
    return Registry.discover(policy if policy is not None else _env_policy())


@functools.lru_cache(maxsize=1)
def _env_policy() -> Policy:
    return Policy.from_env()

