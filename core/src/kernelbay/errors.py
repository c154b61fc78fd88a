"""Exceptions raised by the core. Each carries the offending object and renders a full message."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kernelbay.trace import TraceLine

__all__ = [
    "CheckpointError",
    "ConfigError",
    "ForcedBackendError",
    "KernelbayError",
    "NoBackendError",
    "PluginError",
]


class KernelbayError(Exception):
    """Base class of every error the core raises on purpose."""


class ConfigError(KernelbayError, ValueError):
    """An option, argument or environment variable has a value outside its valid set."""


class PluginError(KernelbayError):
    """A plugin broke the contract (raised only in strict mode; otherwise recorded)."""

    def __init__(self, plugin: str, message: str) -> None:
        self.plugin = plugin
        super().__init__(f"plugin {plugin!r}: {message}")


class CheckpointError(KernelbayError, ValueError):
    """A checkpoint file is missing, malformed, or does not match what a layer expects."""

    def __init__(self, path: str, message: str, *, tensor: str | None = None,
                 field: str | None = None) -> None:
        self.path = path
        self.tensor = tensor
        self.field = field
        where = path
        if tensor is not None:
            where += f", tensor {tensor!r}"
        if field is not None:
            where += f", field {field!r}"
        super().__init__(f"{where}: {message}")


class NoBackendError(KernelbayError):
    """No candidate accepted a request; the message renders the whole decision trace."""

    def __init__(self, message: str, trace: tuple[TraceLine, ...], hints: tuple[str, ...]) -> None:
        self.trace = trace
        self.hints = hints
        super().__init__(message)


class ForcedBackendError(KernelbayError):
    """A forced backend is unknown, blocked, or rejected the request (no silent fall-through)."""

    def __init__(self, message: str, selection_trace: tuple[TraceLine, ...] = ()) -> None:
        self.trace = selection_trace
        super().__init__(message)

