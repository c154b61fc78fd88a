"""A fake plugin that targets an incompatible plugin API major version."""

from __future__ import annotations

from kernelbay import hookimpl

KERNELBAY_PLUGIN_API = "0.3"


@hookimpl
def kernelbay_linear_methods() -> list[type]:
    return []
