"""``kernelbay plugins``: each plugin, its distribution, version, API, status and offers."""

from __future__ import annotations

import json

from kernelbay._table import render_table
from kernelbay._version import PLUGIN_API_VERSION, __version__
from kernelbay.plugins import Registry
from kernelbay.policy import Policy

__all__ = ["plugins_report", "run_plugins"]


def plugins_report(registry: Registry) -> dict[str, object]:
    """The JSON document ``kernelbay plugins --json`` prints (stable keys)."""
    return {
        "core": {"version": __version__, "plugin_api": PLUGIN_API_VERSION},
        "plugins": [r.as_dict() for r in registry.records],
        "notes": list(registry.notes),
    }


def run_plugins(policy: Policy, *, as_json: bool, verbose: bool = False) -> int:
    """Print the plugin table (or JSON); imports no plugin code beyond discovery."""
    registry = Registry.discover(policy)
    if as_json:
        print(json.dumps(plugins_report(registry), indent=2))
        return 0
    rows = []
    for r in registry.records:
        offers = "; ".join(f"{k.value}: {', '.join(v)}" for k, v in r.offers)
        detail = r.reason if r.reason else offers
        if r.reason and offers:
            detail = f"{offers}; {r.reason}"
        rows.append([r.name, r.distribution or "-", r.version or "-", r.api_version or "-",
                     r.status.value, detail])
    print(f"kernelbay {__version__} (plugin API {PLUGIN_API_VERSION})")
    print(render_table(["plugin", "distribution", "version", "api", "status", "offers"], rows))
    for note in registry.notes:
        print(f"note: {note}")
    if verbose:
        for r in registry.records:
            if r.detail:
                print(f"\n{r.name}:\n{r.detail}")
    return 0
