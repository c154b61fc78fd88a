"""Selection: pick one candidate for one request on one device, and explain why.

``select`` is a pure function of (kind, request, device, policy, registry): it asks every
installed candidate, orders them deterministically (forced, then batch invariance when the
policy asks for it, then priority, then name) and returns the first that accepts, with a
trace of one line per candidate. Decisions are cached on the registry.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, final, overload

from kernelbay.backend import Backend
from kernelbay.catalogue import suggest_distribution
from kernelbay.device import DeviceCapability
from kernelbay.errors import ForcedBackendError, NoBackendError, PluginError
from kernelbay.kinds import BackendKind
from kernelbay.layers import (
    AttentionBackend,
    CheckpointFormat,
    Collective,
    LinearMethod,
    MoEMethod,
    Proposer,
)
from kernelbay.plugins import Candidate, PluginStatus, Registry, get_registry
from kernelbay.policy import Policy
from kernelbay.requests import (
    AttentionRequest,
    CollectiveRequest,
    FormatRequest,
    LinearRequest,
    ProposerRequest,
)
from kernelbay.trace import CandidateStatus, TraceLine, render_trace
from kernelbay.verdict import Verdict

__all__ = ["Selection", "ask", "select"]

log = logging.getLogger("kernelbay.select")
BackendT = TypeVar("BackendT", bound=Backend[Any])
_warned: set[tuple[str, str, str]] = set()


@final
@dataclass(frozen=True)
class Selection(Generic[BackendT]):
    """The chosen backend class for one request, its verdict, and the whole trace."""

    kind: BackendKind
    request: object
    device: DeviceCapability
    backend: type[BackendT]
    plugin: str
    verdict: Verdict
    trace: tuple[TraceLine, ...]

    @property
    def name(self) -> str:
        """The chosen backend's name."""
        return self.backend.name

    def render(self) -> str:
        """Several lines: the decision, then the trace table."""
        describe = getattr(self.request, "describe", None)
        what = describe() if callable(describe) else repr(self.request)
        head = (f"{self.kind.label} for {what} on {self.device.describe()}: "
                f"{self.name} (plugin {self.plugin})")
        return head + "\n" + render_trace(self.trace)

    def as_dict(self) -> dict[str, object]:
        """JSON-ready form (stable keys)."""
        return {"kind": self.kind.value, "chosen": self.name, "plugin": self.plugin,
                "notes": list(self.verdict.notes),
                "trace": [line.as_dict() for line in self.trace]}


def ask(backend: type[Backend[Any]], request: object, device: DeviceCapability,
        strict: bool = False) -> Verdict:
    """A candidate's verdict. A probe that raises (or returns a non-Verdict) becomes a
    rejection quoting the exception; under ``strict`` it is re-raised as ``PluginError``."""
    try:
        verdict = backend.can_implement(request, device)
        if not isinstance(verdict, Verdict):
            raise TypeError(f"can_implement returned {verdict!r}, expected a Verdict")
    except Exception as exc:
        if strict:
            raise PluginError(backend.__module__.split(".")[0],
                              f"{backend.name}.can_implement raised "
                              f"{type(exc).__name__}: {exc}") from exc
        return Verdict.reject(f"can_implement raised {type(exc).__name__}: {exc}")
    return verdict


def _not_applicable(backend: type[Backend[Any]], request: object) -> Verdict | None:
    """What selection decides before asking a candidate: a routed-expert request
    (``LinearRequest.num_experts``) is not applicable to a linear method that is not a
    ``MoEMethod``, whatever its ``can_implement`` says (only a ``MoEMethod`` can run the
    experts, so a plugin written for dense layers never takes them)."""
    if isinstance(request, LinearRequest) and request.num_experts \
            and not issubclass(backend, MoEMethod):
        return Verdict.handles(False, f"serves dense layers (not a MoEMethod), the request is "
                                      f"{request.num_experts} routed experts")
    return None


def _blocked_by(candidate: Candidate, policy: Policy) -> str | None:
    if candidate.name in policy.disable:
        return f"backend {candidate.name!r} is named in KERNELBAY_DISABLE"
    if candidate.plugin in policy.disable:
        return f"plugin {candidate.plugin!r} is named in KERNELBAY_DISABLE"
    return None


def _order(candidates: tuple[Candidate, ...], policy: Policy,
           forced: str | None) -> list[Candidate]:
    def key(c: Candidate) -> tuple[int, int, int, str]:
        invariant = 0 if (not policy.batch_invariant or c.backend.batch_invariant) else 1
        return (0 if c.name == forced else 1, invariant, -c.backend.priority, c.name)

    return sorted(candidates, key=key)


@overload
def select(kind: BackendKind, request: LinearRequest, device: DeviceCapability | None = ...,
           policy: Policy | None = ..., *, registry: Registry | None = ...
           ) -> Selection[LinearMethod]: ...
@overload
def select(kind: BackendKind, request: AttentionRequest, device: DeviceCapability | None = ...,
           policy: Policy | None = ..., *, registry: Registry | None = ...
           ) -> Selection[AttentionBackend]: ...
@overload
def select(kind: BackendKind, request: ProposerRequest, device: DeviceCapability | None = ...,
           policy: Policy | None = ..., *, registry: Registry | None = ...
           ) -> Selection[Proposer]: ...
@overload
def select(kind: BackendKind, request: CollectiveRequest, device: DeviceCapability | None = ...,
           policy: Policy | None = ..., *, registry: Registry | None = ...
           ) -> Selection[Collective]: ...
@overload
def select(kind: BackendKind, request: FormatRequest, device: DeviceCapability | None = ...,
           policy: Policy | None = ..., *, registry: Registry | None = ...
           ) -> Selection[CheckpointFormat]: ...
@overload
def select(kind: BackendKind, request: object, device: DeviceCapability | None = ...,
           policy: Policy | None = ..., *, registry: Registry | None = ...
           ) -> Selection[Any]: ...
def select(kind: BackendKind, request: Any, device: DeviceCapability | None = None,
           policy: Policy | None = None, *, registry: Registry | None = None
           ) -> Selection[Any]:
    """Choose the backend of ``kind`` for ``request`` on ``device`` under ``policy``.

    Raises ``ForcedBackendError`` when a forced backend is unknown, blocked or rejects, and
    ``NoBackendError`` (rendering the whole trace and what to install or set) when nothing
    accepts. Defaults: the process registry, its policy and its device.
    """
    if registry is None:
        registry = get_registry(policy)
    policy = registry.policy if policy is None else policy
    device = registry.device() if device is None else device
    cache_key = (kind, request, device, policy)
    cached = registry.decisions.get(cache_key)
    if cached is not None:
        return cached  # type: ignore[return-value]
    selection = _decide(kind, request, device, policy, registry)
    registry.decisions[cache_key] = selection
    return selection


def _decide(kind: BackendKind, request: Any, device: DeviceCapability, policy: Policy,
            registry: Registry) -> Selection[Any]:
    forced = policy.forced(kind)
    candidates = registry.candidates(kind)
    if forced is not None and forced not in {c.name for c in candidates}:
        valid = sorted(c.name for c in candidates)
        raise ForcedBackendError(f"{kind.force_variable}={forced!r} names no installed "
                                 f"{kind.label}; valid: {valid}")
    lines: list[TraceLine] = []
    chosen: tuple[Candidate, Verdict] | None = None
    passed_over: list[tuple[Candidate, Verdict]] = []
    for candidate in _order(candidates, policy, forced):
        cls = candidate.backend
        blocked = _blocked_by(candidate, policy)
        if blocked is not None:
            if candidate.name == forced:
                raise ForcedBackendError(f"{kind.force_variable}={forced!r}, but {blocked}")
            lines.append(TraceLine(cls.name, candidate.plugin, CandidateStatus.BLOCKED,
                                   blocked, cls.priority))
            continue
        verdict = _not_applicable(cls, request)
        if verdict is None:
            verdict = ask(cls, request, device, policy.strict)
        is_chosen = verdict.accepted and chosen is None
        if is_chosen:
            chosen = (candidate, verdict)
        elif not verdict.accepted and chosen is None:
            passed_over.append((candidate, verdict))
        status = CandidateStatus.ACCEPTED if verdict.accepted else CandidateStatus.REJECTED
        lines.append(TraceLine(cls.name, candidate.plugin, status, verdict.describe(),
                               cls.priority, is_chosen, verdict.applicable))
        if candidate.name == forced and not verdict.accepted:
            raise ForcedBackendError(
                f"{kind.force_variable}={forced!r}, but it rejects "
                f"{_describe(request)} on {device.describe()}: {verdict.reason}",
                tuple(lines))
    lines.extend(registry.problems(kind))
    trace = tuple(lines)
    if chosen is None:
        raise _no_backend(kind, request, device, policy, registry, trace)
    candidate, verdict = chosen
    _warn_fallback(kind, candidate, passed_over)
    return Selection(kind, request, device, candidate.backend, candidate.plugin, verdict, trace)


def _describe(request: object) -> str:
    describe = getattr(request, "describe", None)
    return str(describe()) if callable(describe) else repr(request)


def _warn_fallback(kind: BackendKind, chosen: Candidate,
                   passed_over: list[tuple[Candidate, Verdict]]) -> None:
    preferred = [(c, v) for c, v in passed_over
                 if v.applicable and c.backend.priority > chosen.backend.priority]
    if not preferred:
        return
    best, verdict = preferred[0]
    key = (kind.value, best.name, verdict.reason)
    if key in _warned:
        return
    _warned.add(key)
    log.warning("%s %r (plugin %r) is preferred but rejected: %s; using %r instead",
                kind.label, best.name, best.plugin, verdict.reason, chosen.name)


def _no_backend(kind: BackendKind, request: Any, device: DeviceCapability, policy: Policy,
                registry: Registry, trace: tuple[TraceLine, ...]) -> NoBackendError:
    hints: list[str] = []
    installed = {r.distribution for r in registry.records}
    suggestion = suggest_distribution(kind, request)
    if suggestion is not None and suggestion not in installed:
        hints.append(f"install the plugin that handles it: pip install {suggestion}")
    for line in trace:
        if line.status is CandidateStatus.BLOCKED and "KERNELBAY_DISABLE" in line.reason:
            hints.append(f"remove {line.backend!r} / {line.plugin!r} from KERNELBAY_DISABLE")
        elif line.status is CandidateStatus.FAILED:
            hints.append(f"fix or reinstall plugin {line.plugin!r} ({line.reason})")
        elif line.status is CandidateStatus.INCOMPATIBLE:
            hints.append(f"upgrade plugin {line.plugin!r} or the core ({line.reason})")
    for record in registry.records:
        if record.status is PluginStatus.NOT_ALLOWED:
            hints.append(f"plugin {record.name!r} is installed but not in KERNELBAY_PLUGINS")
    if any(line.status is CandidateStatus.REJECTED for line in trace):
        hints.append("each rejection above says what it needs; to plan for other hardware "
                     "use --device / KERNELBAY_DEVICE (e.g. sm_90, sm_100, cpu+amx)")
    message = (f"no {kind.label} accepts {_describe(request)} on {device.describe()}\n"
               f"{render_trace(trace) if trace else '  (no candidates installed)'}")
    if hints:
        message += "\nwhat to do:\n" + "\n".join(f"  - {h}" for h in dict.fromkeys(hints))
    return NoBackendError(message, trace, tuple(dict.fromkeys(hints)))
