"""The always-available n-gram (prompt-lookup) proposer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from kernelbay._version import PLUGIN_API_VERSION
from kernelbay.layers.proposer import DraftBuffers, DraftContext, DraftLogitsSpec, Proposer
from kernelbay.requests import ProposerRequest
from kernelbay.verdict import Verdict

if TYPE_CHECKING:
    import torch

    from kernelbay.device import DeviceCapability

__all__ = ["NGramProposer", "ngram_lookup"]


def ngram_lookup(tokens: Sequence[int], k: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix
    n-gram (``max_n`` down to ``min_n``) of ``tokens``; empty when no suffix recurs."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = list(tokens[length - n:])
        # Scan right to left: the most recent match predicts best.
        for start in range(length - n - 1, -1, -1):
            if list(tokens[start:start + n]) == suffix:
                follow = list(tokens[start + n:start + n + k])
                if follow:
                    return follow
    return []


class NGramProposer(Proposer):
    """Prompt lookup: copy what followed the latest earlier occurrence of the context's tail.

    Its draft distribution is top-1 with probability 1 (the draft is deterministic). It
    reads no hidden states (``hidden_state_spec`` is None) and ignores the sampling
    parameters: the verifier alone decides what is kept.
    """

    name: ClassVar[str] = "ngram"
    api_version: ClassVar[str] = PLUGIN_API_VERSION
    priority: ClassVar[int] = 0
    batch_invariant: ClassVar[bool] = True
    summary: ClassVar[str] = "n-gram prompt lookup, any device"
    max_n: ClassVar[int] = 4
    min_n: ClassVar[int] = 1

    @classmethod
    def can_implement(cls, request: ProposerRequest, device: DeviceCapability) -> Verdict:
        return Verdict.all(
            Verdict.handles(request.method == "ngram",
                          f"implements method 'ngram', request asks {request.method!r}"),
            Verdict.check(request.num_speculative_tokens >= 1,
                          f"needs num_speculative_tokens >= 1, got "
                          f"{request.num_speculative_tokens}"),
        )

    def draft_logits_spec(self) -> DraftLogitsSpec:
        return DraftLogitsSpec("topc", 1)

    def propose(self, token_ids: Sequence[torch.Tensor], out: DraftBuffers,
                context: DraftContext | None = None) -> None:
        import torch

        del context  # drafts depend on the tokens only

        k = out.tokens.shape[1]
        assert out.candidate_ids is not None and out.candidate_probs is not None
        for b, tokens in enumerate(token_ids):
            draft = ngram_lookup(tokens.tolist(), k, self.max_n, self.min_n)
            n = len(draft)
            out.num_drafted[b] = n
            out.tokens[b].zero_()
            out.candidate_ids[b].zero_()
            out.candidate_probs[b].zero_()
            if n:
                ids = torch.tensor(draft, dtype=out.tokens.dtype, device=out.tokens.device)
                out.tokens[b, :n] = ids
                out.candidate_ids[b, :n, 0] = ids
                out.candidate_probs[b, :n, 0] = 1.0
