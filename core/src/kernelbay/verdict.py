"""Verdicts: a candidate's answer to "can you implement this request on this device?"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import final

__all__ = ["Verdict"]


@final
@dataclass(frozen=True)
class Verdict:
    """Accepted (with optional notes) or rejected with a full-sentence reason.

    A rejection names both sides of the mismatch, e.g. "needs compute capability >= 10.0,
    device has 9.0" or "N=4100 is not a multiple of 32". Use ``handles`` for what the backend
    is for (scheme, attention kind, format) and ``check`` for what it needs (device, shapes).
    """

    accepted: bool
    reason: str = ""
    notes: tuple[str, ...] = ()
    #: False when the request is outside what the backend is for (another scheme, another
    #: attention kind): such a rejection is never a "fallback" worth a warning.
    applicable: bool = True

    def __post_init__(self) -> None:
        if not self.accepted and not self.reason.strip():
            raise ValueError("a rejecting Verdict needs a non-empty reason")

    @classmethod
    def accept(cls, *notes: str) -> Verdict:
        """An acceptance, optionally with notes shown in traces."""
        return cls(True, "", tuple(n for n in notes if n))

    @classmethod
    def reject(cls, reason: str) -> Verdict:
        """A rejection; ``reason`` must say what was needed and what was found."""
        return cls(False, reason)

    @classmethod
    def check(cls, condition: bool, reason: str) -> Verdict:
        """Accept when ``condition`` holds, else reject with ``reason``."""
        return cls.accept() if condition else cls.reject(reason)

    @classmethod
    def handles(cls, condition: bool, reason: str) -> Verdict:
        """Accept when the request is of the kind this backend is for; otherwise a
        not-applicable rejection (shown in traces, never warned about as a fallback)."""
        return cls.accept() if condition else cls(False, reason, (), False)

    @classmethod
    def all(cls, *verdicts: Verdict) -> Verdict:
        """The first rejection among ``verdicts``, else one acceptance carrying all notes."""
        notes: list[str] = []
        for verdict in verdicts:
            if not verdict.accepted:
                return verdict
            notes.extend(verdict.notes)
        return cls(True, "", tuple(notes))

    def __bool__(self) -> bool:
        return self.accepted

    def describe(self) -> str:
        """One line: the reason when rejected, the notes when accepted."""
        if not self.accepted:
            return self.reason
        return "; ".join(self.notes)
