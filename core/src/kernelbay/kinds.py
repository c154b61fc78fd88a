"""The five backend kinds, and the names derived from each (hook, environment variable)."""

from __future__ import annotations

from enum import Enum

__all__ = ["BackendKind"]


class BackendKind(str, Enum):
    """A family of backends: one hook returns the candidates of each kind."""

    CHECKPOINT_FORMAT = "checkpoint_format"
    LINEAR = "linear"
    ATTENTION = "attention"
    PROPOSER = "proposer"
    COLLECTIVE = "collective"

    @property
    def hook_name(self) -> str:
        """Name of the hook whose implementations return candidates of this kind."""
        return _HOOKS[self]

    @property
    def force_variable(self) -> str:
        """Environment variable that forces one backend of this kind."""
        return "KERNELBAY_FORCE_" + self.value.upper()

    @property
    def label(self) -> str:
        """Human label, e.g. 'linear method'."""
        return _LABELS[self]

    @classmethod
    def parse(cls, value: str) -> BackendKind:
        """Parse a kind from its value ('linear') or its upper-case variable suffix ('LINEAR')."""
        for kind in cls:
            if value.lower() == kind.value:
                return kind
        valid = ", ".join(repr(k.value) for k in cls)
        raise ValueError(f"unknown backend kind {value!r}; valid kinds: {valid}")


_HOOKS = {
    BackendKind.CHECKPOINT_FORMAT: "kernelbay_checkpoint_formats",
    BackendKind.LINEAR: "kernelbay_linear_methods",
    BackendKind.ATTENTION: "kernelbay_attention_backends",
    BackendKind.PROPOSER: "kernelbay_proposers",
    BackendKind.COLLECTIVE: "kernelbay_collectives",
}

_LABELS = {
    BackendKind.CHECKPOINT_FORMAT: "checkpoint format",
    BackendKind.LINEAR: "linear method",
    BackendKind.ATTENTION: "attention backend",
    BackendKind.PROPOSER: "proposer",
    BackendKind.COLLECTIVE: "collective",
}
