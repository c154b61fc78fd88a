"""Speculative proposers: draft a block of tokens, and the distribution they were drawn from.

A proposer declares the shape of its draft distribution (``draft_logits_spec``); the core
allocates the buffers once (``DraftBuffers.allocate``) and ``propose`` fills them, so no
proposer allocates its own copy per step.
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

__all__ = ["DraftBuffers", "DraftLogitsSpec", "Proposer"]


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


class Proposer(Backend[ProposerRequest]):
    """Drafts up to k tokens per request for the verifier; an instance serves one target model."""

    kind: ClassVar[BackendKind] = BackendKind.PROPOSER

    def __init__(self, request: ProposerRequest) -> None:
        self.request = request

    def draft_logits_spec(self) -> DraftLogitsSpec:
        """The draft distribution this proposer returns."""
        raise NotImplementedError(f"{type(self).__qualname__} does not implement "
                                  "draft_logits_spec")

    def propose(self, token_ids: Sequence[torch.Tensor], out: DraftBuffers) -> None:
        """Fill ``out`` with drafts continuing each request's ``token_ids`` (1-D tensors)."""
        raise NotImplementedError(f"{type(self).__qualname__} does not implement propose")
