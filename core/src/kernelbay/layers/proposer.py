"""Speculative proposers: draft a block of tokens, and the distribution they were drawn from.

A proposer declares the shape of its draft distribution (``draft_logits_spec``); the core
allocates the buffers once (``DraftBuffers.allocate``) and ``propose`` fills them, so no
proposer allocates its own copy per step. A proposer that reads the target's hidden states
declares which (``hidden_state_spec``); the engine captures exactly those layers during every
target forward (prefill and verification) into a window it allocates once, and hands them to
``propose`` in a ``DraftContext`` together with each request's sampling seed and temperature.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, final

from kernelbay.backend import Backend
from kernelbay.kinds import BackendKind
from kernelbay.requests import ProposerRequest

if TYPE_CHECKING:
    import torch

__all__ = ["DraftBuffers", "DraftContext", "DraftLogitsSpec", "HiddenStateSpec", "Proposer"]


@final
@dataclass(frozen=True)
class DraftLogitsSpec:
    """Shape of the draft distribution: ``"full"`` vocabulary logits, or ``"topc"``
    candidate ids with their probabilities (``num_candidates`` per slot)."""

    kind: str
    num_candidates: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("full", "topc"):
            raise ValueError(f"DraftLogitsSpec.kind must be 'full' or 'topc', got {self.kind!r}")
        if self.kind == "topc" and self.num_candidates < 1:
            raise ValueError(f"a 'topc' spec needs num_candidates >= 1, got {self.num_candidates}")


@dataclass
class DraftBuffers:
    """Draft outputs for a batch: ``tokens`` [B, k], ``num_drafted`` [B], and either
    ``logits`` [B, k, V] (full) or ``candidate_ids`` / ``candidate_probs`` [B, k, c] (top-c)."""

    tokens: torch.Tensor
    num_drafted: torch.Tensor
    logits: torch.Tensor | None = None
    candidate_ids: torch.Tensor | None = None
    candidate_probs: torch.Tensor | None = None

    @classmethod
    def allocate(cls, spec: DraftLogitsSpec, batch: int, k: int, vocab_size: int,
                 device: torch.device | str = "cpu") -> DraftBuffers:
        """Allocate once per batch size; proposers fill these in place."""
        import torch

        tokens = torch.zeros((batch, k), dtype=torch.long, device=device)
        drafted = torch.zeros((batch,), dtype=torch.long, device=device)
        if spec.kind == "full":
            return cls(tokens, drafted,
                       logits=torch.zeros((batch, k, vocab_size), device=device))
        c = spec.num_candidates
        return cls(tokens, drafted,
                   candidate_ids=torch.zeros((batch, k, c), dtype=torch.long, device=device),
                   candidate_probs=torch.zeros((batch, k, c), device=device))


@final
@dataclass(frozen=True)
class HiddenStateSpec:
    """Target hidden states a proposer reads: ``layers`` and the latest ``window`` positions.

    Layer indices follow Hugging Face's ``output_hidden_states``: 0 is the embedding output,
    ``i`` (1..N) the output of decoder layer ``i``, and ``N`` is taken after the final norm
    (the states the LM head reads); negative indices count from the end (-1 = N).
    """

    layers: tuple[int, ...]
    window: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(int(i) for i in self.layers))
        if not self.layers:
            raise ValueError("HiddenStateSpec.layers must name at least one layer, got ()")
        if self.window < 1:
            raise ValueError(f"HiddenStateSpec.window must be >= 1, got {self.window}")

    def resolve(self, num_layers: int) -> tuple[int, ...]:
        """The layer indices in ``[0, num_layers]`` for a target of ``num_layers`` layers."""
        resolved = tuple(i if i >= 0 else num_layers + 1 + i for i in self.layers)
        bad = [i for i, r in zip(self.layers, resolved, strict=True)
               if not 0 <= r <= num_layers]
        if bad:
            raise ValueError(f"HiddenStateSpec.layers {list(self.layers)}: {bad} out of range "
                             f"for a target of {num_layers} layers (valid: -{num_layers + 1}"
                             f"..{num_layers})")
        return resolved


@dataclass
class DraftContext:
    """What ``propose`` gets besides the token ids, one row per request.

    ``num_cached`` [B]: positions ``0 .. num_cached - 1`` have been through the target; the
    tokens after them (usually only the last one) have not. ``hidden_states``
    [B, window, n_layers, hidden] (None when the proposer declared no ``HiddenStateSpec``):
    the target's states at the declared layers for the latest ``num_hidden`` [B] of those
    positions, right-aligned, so row ``window - 1`` is position ``num_cached - 1``; rows
    before ``window - num_hidden`` are stale. ``temperature`` [B] float and ``seed`` [B]
    int64 are the requests' sampling parameters (temperature 0: greedy); the draft token of
    slot ``t`` will occupy position ``len(token_ids[b]) + t``.
    """

    num_cached: torch.Tensor
    temperature: torch.Tensor
    seed: torch.Tensor
    hidden_states: torch.Tensor | None = None
    num_hidden: torch.Tensor | None = None


class Proposer(Backend[ProposerRequest]):
    """Drafts up to k tokens per request for the verifier; an instance serves one target model."""

    kind: ClassVar[BackendKind] = BackendKind.PROPOSER

    def __init__(self, request: ProposerRequest) -> None:
        self.request = request

    def draft_logits_spec(self) -> DraftLogitsSpec:
        """The draft distribution this proposer returns."""
        raise NotImplementedError(f"{type(self).__qualname__} does not implement "
                                  "draft_logits_spec")

    def hidden_state_spec(self) -> HiddenStateSpec | None:
        """The target hidden states ``propose`` reads (default: none)."""
        return None

    def propose(self, token_ids: Sequence[torch.Tensor], out: DraftBuffers,
                context: DraftContext | None = None) -> None:
        """Fill rows ``0 .. len(token_ids) - 1`` of ``out`` with drafts continuing each
        request's ``token_ids`` (1-D tensors). ``context`` carries the declared hidden states
        and the sampling parameters; the engine always passes it."""
        raise NotImplementedError(f"{type(self).__qualname__} does not implement propose")
