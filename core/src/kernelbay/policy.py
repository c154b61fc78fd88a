"""Selection policy: which plugins load, which backends are disabled or forced.

Explicit arguments come first; environment variables are read once, at the boundary, by
``Policy.from_env``. Nothing deeper in the core reads the environment.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import final

from kernelbay.errors import ConfigError
from kernelbay.kinds import BackendKind

__all__ = ["ENV_VARIABLES", "Policy"]

#: Every environment variable the core reads, with its meaning (documented in the user guide).
ENV_VARIABLES: dict[str, str] = {
    "KERNELBAY_PLUGINS": "allowlist of plugin names to load (comma separated); set but empty "
                         "means core only",
    "KERNELBAY_DISABLE": "names of plugins or backends never to use (comma separated)",
    "KERNELBAY_STRICT": "1: a plugin that fails to load or a probe that raises is an error",
    "KERNELBAY_DEVICE": "describe a device instead of probing it (sm_90, sm_100, gfx950, cpu+amx)",
    "KERNELBAY_BATCH_INVARIANT": "1: prefer backends whose results do not depend on batch size",
    **{k.force_variable: f"force this {k.label} by name; if it rejects, raise with its reason"
       for k in BackendKind},
}

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def _names(text: str) -> frozenset[str]:
    return frozenset(n.strip() for n in text.replace(" ", ",").split(",") if n.strip())


def _flag(variable: str, text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{variable}={text!r} is not a boolean; use one of {_TRUE + _FALSE[1:]}")


@final
@dataclass(frozen=True)
class Policy:
    """What may load and what may be chosen. Hashable, so decisions can be cached on it.

    ``plugins`` is an allowlist (``None``: every installed plugin; empty: core only).
    ``disable`` names plugins or backends never to use. ``force`` maps a kind to the one
    backend name that must be used for it.
    """

    plugins: frozenset[str] | None = None
    disable: frozenset[str] = field(default_factory=frozenset)
    force: tuple[tuple[BackendKind, str], ...] = ()
    strict: bool = False
    device: str | None = None
    batch_invariant: bool = False

    def forced(self, kind: BackendKind) -> str | None:
        """Name of the backend forced for ``kind``, if any."""
        for forced_kind, name in self.force:
            if forced_kind is kind:
                return name
        return None

    def with_force(self, kind: BackendKind, name: str | None) -> Policy:
        """A copy forcing ``name`` for ``kind`` (``None`` removes the force)."""
        rest = tuple((k, n) for k, n in self.force if k is not kind)
        if name is not None:
            rest = (*rest, (kind, name))
        return replace(self, force=tuple(sorted(rest, key=lambda kn: kn[0].value)))

    def updated(self, **changes: object) -> Policy:
        """A copy with explicit overrides (explicit arguments win over the environment)."""
        return replace(self, **changes)  # type: ignore[arg-type]

    @classmethod
    def make(
        cls,
        *,
        plugins: Iterable[str] | None = None,
        disable: Iterable[str] = (),
        force: Mapping[BackendKind | str, str] | None = None,
        strict: bool = False,
        device: str | None = None,
        batch_invariant: bool = False,
    ) -> Policy:
        """Build a policy from plain Python values."""
        forced = tuple(sorted(((BackendKind.parse(k) if isinstance(k, str) else k, v)
                               for k, v in (force or {}).items()), key=lambda kn: kn[0].value))
        return cls(None if plugins is None else frozenset(plugins), frozenset(disable), forced,
                   strict, device, batch_invariant)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Policy:
        """Read the ``KERNELBAY_*`` variables once. Unknown ``KERNELBAY_FORCE_*`` kinds and
        malformed booleans raise ``ConfigError`` naming the variable and the valid set."""
        env = os.environ if environ is None else environ
        plugins = _names(env["KERNELBAY_PLUGINS"]) if "KERNELBAY_PLUGINS" in env else None
        force: dict[BackendKind | str, str] = {}
        for key, value in env.items():
            if key.startswith("KERNELBAY_FORCE_") and value.strip():
                suffix = key[len("KERNELBAY_FORCE_"):]
                try:
                    force[BackendKind.parse(suffix)] = value.strip()
                except ValueError:
                    valid = ", ".join(k.force_variable for k in BackendKind)
                    raise ConfigError(f"{key} names no backend kind; valid: {valid}") from None
        return cls.make(
            plugins=plugins,
            disable=_names(env.get("KERNELBAY_DISABLE", "")),
            force=force,
            strict=_flag("KERNELBAY_STRICT", env.get("KERNELBAY_STRICT", "")),
            device=env.get("KERNELBAY_DEVICE") or None,
            batch_invariant=_flag("KERNELBAY_BATCH_INVARIANT",
                                  env.get("KERNELBAY_BATCH_INVARIANT", "")),
        )
