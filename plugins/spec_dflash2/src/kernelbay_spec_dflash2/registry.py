"""A registry with this plugin loaded, for scripts that run from a source checkout."""

from __future__ import annotations

from kernelbay import Policy, Registry

__all__ = ["dflash2_registry"]


def dflash2_registry() -> Registry:
    """The core plus this plugin and nothing else: discovered when the distribution is
    installed, registered from this package otherwise (a checkout on ``sys.path``)."""
    from importlib.metadata import entry_points

    if any(ep.name == "spec_dflash2" for ep in entry_points(group="kernelbay.plugins")):
        return Registry.discover(Policy(plugins=frozenset({"spec_dflash2"})))
    from kernelbay_spec_dflash2 import plugin

    registry = Registry(Policy(plugins=frozenset()))
    registry.register(plugin, "spec_dflash2")
    return registry
