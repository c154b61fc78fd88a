"""The base class every candidate derives from, whatever its kind."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Generic, TypeVar

if TYPE_CHECKING:
    from kernelbay.device import DeviceCapability
    from kernelbay.kinds import BackendKind
    from kernelbay.verdict import Verdict

__all__ = ["Backend", "RequestT"]

RequestT = TypeVar("RequestT")


class Backend(Generic[RequestT]):
    """A candidate implementation of one backend kind.

    Subclasses set ``name`` (unique across all installed plugins), ``priority`` (higher is
    preferred), ``api_version`` (the plugin API they target, ``"MAJOR.MINOR"``) and implement
    ``can_implement``. Keep the defining module free of heavy imports: import torch, triton or
    a compiled extension inside methods, or in a module those methods import.
    """

    kind: ClassVar[BackendKind]
    name: ClassVar[str]
    api_version: ClassVar[str]
    priority: ClassVar[int] = 0
    #: True when results never depend on the batch composition (batch-invariant mode).
    batch_invariant: ClassVar[bool] = False
    #: One line shown by ``kernelbay plugins``.
    summary: ClassVar[str] = ""

    @classmethod
    def can_implement(cls, request: RequestT, device: DeviceCapability) -> Verdict:
        """Accept, or reject with a sentence naming what is needed and what was found."""
        raise NotImplementedError(f"{cls.__qualname__} does not implement can_implement")
