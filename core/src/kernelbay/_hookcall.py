"""The one module that calls hooks: one plugin at a time, typed, and isolated.

Each plugin's hook implementations are called separately, so one that raises or returns
garbage is recorded against that plugin alone and never hides another plugin's offers.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pluggy

from kernelbay import hookspecs
from kernelbay.backend import Backend
from kernelbay.kinds import BackendKind
from kernelbay.layers import (
    AttentionBackend,
    CheckpointFormat,
    Collective,
    DeviceProbe,
    LinearMethod,
    Proposer,
)

__all__ = ["BASE_CLASSES", "Offers", "api_compatible", "collect_offers", "unknown_hooks"]

#: The base class every candidate of a kind must derive from.
BASE_CLASSES: dict[BackendKind, type[Backend[Any]]] = {
    BackendKind.CHECKPOINT_FORMAT: CheckpointFormat,
    BackendKind.LINEAR: LinearMethod,
    BackendKind.ATTENTION: AttentionBackend,
    BackendKind.PROPOSER: Proposer,
    BackendKind.COLLECTIVE: Collective,
}

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")
_API_RE = re.compile(r"^(\d+)\.(\d+)$")
PROBE_HOOK = "kernelbay_device_probes"
KNOWN_HOOKS = frozenset(k.hook_name for k in BackendKind) | {PROBE_HOOK}


def api_compatible(target: object, core: str) -> str | None:
    """``None`` when a plugin targeting API ``target`` runs on core API ``core``, else why not."""
    if not isinstance(target, str) or not _API_RE.match(target):
        return f"declares plugin API {target!r}, expected a 'MAJOR.MINOR' string"
    want = _API_RE.match(target)
    have = _API_RE.match(core)
    assert want is not None and have is not None
    if want.group(1) != have.group(1):
        return (f"targets plugin API {target}, this core implements {core} "
                f"(major versions differ)")
    if int(want.group(2)) > int(have.group(2)):
        return f"targets plugin API {target}, newer than this core's {core}"
    return None


@dataclass
class Offers:
    """What one plugin's hooks returned: valid classes per kind, probes, and problems.

    ``problems`` are (kind or None, backend name or "", status word, reason); status word is
    ``"failed"`` (hook raised or returned garbage) or ``"incompatible"``.
    """

    classes: dict[BackendKind, list[type[Backend[Any]]]] = field(
        default_factory=lambda: {k: [] for k in BackendKind})
    probes: list[DeviceProbe] = field(default_factory=list)
    problems: list[tuple[BackendKind | None, str, str, str]] = field(default_factory=list)


def unknown_hooks(pm: pluggy.PluginManager, plugin: object) -> list[str]:
    """Names of functions marked as hook implementations that match no hook specification."""
    bad = []
    for attr in dir(plugin):
        if not attr.startswith("kernelbay_"):
            continue
        try:
            opts = pm.parse_hookimpl_opts(plugin, attr)
        except Exception:
            opts = None
        if opts is not None and attr not in KNOWN_HOOKS:
            bad.append(attr)
    return bad


def _call_own(pm: pluggy.PluginManager, hook_name: str, plugin: object) -> list[tuple[bool, Any]]:
    caller = getattr(pm.hook, hook_name)
    results: list[tuple[bool, Any]] = []
    for impl in caller.get_hookimpls():
        if impl.plugin is not plugin:
            continue
        try:
            results.append((True, impl.function()))
        except Exception as exc:
            results.append((False, exc))
    return results


def _as_sequence(value: Any) -> Sequence[Any] | None:
    if value is None:
        return ()
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        return None
    return value


def _check_class(kind: BackendKind, obj: Any, core_api: str) -> tuple[str, str, str] | None:
    """``None`` when ``obj`` is a valid candidate of ``kind``, else (name, status, reason)."""
    base = BASE_CLASSES[kind]
    if not isinstance(obj, type) or not issubclass(obj, base):
        return ("", "failed", f"{kind.hook_name} returned {obj!r}, expected a subclass of "
                              f"{base.__module__}.{base.__qualname__}")
    name = obj.__dict__.get("name", getattr(obj, "name", None))
    if not isinstance(name, str) or not _NAME_RE.match(name):
        return ("", "failed", f"{obj.__qualname__} has name {name!r}, expected a non-empty "
                              "string of letters, digits and . _ + -")
    if not isinstance(getattr(obj, "priority", None), int):
        return (name, "failed", f"{obj.__qualname__}.priority is {obj.priority!r}, expected an "
                                "int")
    if obj.can_implement.__func__ is Backend.can_implement.__func__:  # type: ignore[attr-defined]
        return (name, "failed", f"{obj.__qualname__} does not implement can_implement")
    why = api_compatible(getattr(obj, "api_version", None), core_api)
    if why is not None:
        return (name, "incompatible", f"{obj.__qualname__} {why}")
    return None


def collect_offers(pm: pluggy.PluginManager, plugin: object, core_api: str) -> Offers:
    """Call each of ``plugin``'s hooks in isolation and validate what they return."""
    offers = Offers()
    for kind in BackendKind:
        for ok, value in _call_own(pm, kind.hook_name, plugin):
            if not ok:
                offers.problems.append((kind, "", "failed", f"{kind.hook_name} raised "
                                        f"{type(value).__name__}: {value}"))
                continue
            items = _as_sequence(value)
            if items is None:
                offers.problems.append((kind, "", "failed", f"{kind.hook_name} returned "
                                        f"{value!r}, expected a list of classes"))
                continue
            for obj in items:
                bad = _check_class(kind, obj, core_api)
                if bad is None:
                    offers.classes[kind].append(obj)
                else:
                    offers.problems.append((kind, *bad))
    for ok, value in _call_own(pm, PROBE_HOOK, plugin):
        items = _as_sequence(value) if ok else None
        if not ok or items is None:
            what = f"raised {type(value).__name__}: {value}" if not ok else f"returned {value!r}"
            offers.problems.append((None, "", "failed", f"{PROBE_HOOK} {what}, expected a "
                                    "list of device probes"))
            continue
        for probe in items:
            if isinstance(probe, DeviceProbe) and isinstance(getattr(probe, "name", None), str):
                offers.probes.append(probe)
            else:
                offers.problems.append((None, "", "failed", f"{PROBE_HOOK} returned "
                                        f"{probe!r}, expected an object with name, probe() "
                                        "and parse()"))
    return offers


def add_hookspecs(pm: pluggy.PluginManager) -> None:
    """Register the core's hook specifications on a fresh plugin manager."""
    pm.add_hookspecs(hookspecs)
