"""Decision traces: one line per installed candidate, and their rendering."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import final

__all__ = ["CandidateStatus", "TraceLine", "render_trace"]


class CandidateStatus(str, Enum):
    """What happened to one candidate in one decision."""

    ACCEPTED = "accepted"
    REJECTED = "rejected"
    BLOCKED = "blocked"
    FAILED = "failed to load"
    INCOMPATIBLE = "incompatible API"


@final
@dataclass(frozen=True)
class TraceLine:
    """One candidate's outcome. ``backend`` is the backend name, or ``<plugin>`` for a plugin
    that offered nothing usable (failed to load, incompatible)."""

    backend: str
    plugin: str
    status: CandidateStatus
    reason: str = ""
    priority: int | None = None
    chosen: bool = False
    #: False for a rejection of a request outside what the backend is for.
    applicable: bool = True

    def as_dict(self) -> dict[str, object]:
        """JSON-ready form (stable keys)."""
        return {"backend": self.backend, "plugin": self.plugin, "status": self.status.value,
                "reason": self.reason, "priority": self.priority, "chosen": self.chosen,
                "applicable": self.applicable}


def render_trace(lines: tuple[TraceLine, ...], indent: str = "  ") -> str:
    """A terminal table of the trace; the chosen line is marked with ``*``."""
    from kernelbay._table import render_table

    rows = [["*" if line.chosen else "", line.backend, line.plugin,
             "" if line.priority is None else str(line.priority), line.status.value,
             line.reason] for line in lines]
    table = render_table(["", "backend", "plugin", "prio", "status", "reason"], rows)
    return "\n".join(indent + row for row in table.splitlines())
