"""The ``dflash2`` proposer: the core's Proposer contract around a DFlash2 drafter.

This module imports no torch at module level (discovery imports it).

Provisional interface for target hidden states: before each ``propose`` call the engine
calls ``set_context(hidden_states)`` with one tensor per request, the target's hidden states
at the drafter's ``target_layer_ids`` for that request's latest positions (last row = the
last token of ``token_ids``), shaped ``[L_b, len(target_layer_ids), target_hidden_size]`` (or
already concatenated, ``[L_b, len(target_layer_ids) * target_hidden_size]``). ``propose``
consumes the context, so a stale one is never reused.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from kernelbay.layers import DraftBuffers, DraftLogitsSpec, Proposer
from kernelbay.requests import ProposerRequest
from kernelbay.verdict import Verdict

from kernelbay_spec_dflash2.config import CONFIG_NAME, WEIGHTS_NAME, read_drafter_config

if TYPE_CHECKING:
    import torch
    from kernelbay.device import DeviceCapability

    from kernelbay_spec_dflash2.drafter import DFlash2Drafter

__all__ = ["DFlash2Proposer", "drafter_verdict"]


def drafter_verdict(request: ProposerRequest) -> Verdict:
    """Whether ``request.drafter`` names a usable drafter folder for the request's target."""
    folder = request.drafter
    if folder is None:
        return Verdict.reject(f"no drafter weights given: the request's drafter is None; "
                              f"dflash2 needs a folder with {CONFIG_NAME!r} and "
                              f"{WEIGHTS_NAME!r}")
    if not os.path.isdir(folder):
        return Verdict.reject(f"drafter folder {folder!r} does not exist")
    missing = [n for n in (CONFIG_NAME, WEIGHTS_NAME)
               if not os.path.isfile(os.path.join(folder, n))]
    if missing:
        return Verdict.reject(f"drafter folder {folder!r} lacks {missing}; it needs "
                              f"{[CONFIG_NAME, WEIGHTS_NAME]}")
    try:
        config = read_drafter_config(folder)
    except (OSError, ValueError) as exc:
        return Verdict.reject(f"drafter config in {folder!r} cannot be used: {exc}")
    return Verdict.all(
        Verdict.check(config.target_model_type == request.model_type,
                      f"drafter {folder!r} was trained for target model_type "
                      f"{config.target_model_type!r}, the request's target is "
                      f"{request.model_type!r}"),
        Verdict.check(config.target_hidden_size == request.hidden_size,
                      f"drafter {folder!r} reads target hidden_size "
                      f"{config.target_hidden_size}, the request's target has "
                      f"{request.hidden_size}"),
        Verdict.check(config.vocab_size == request.vocab_size,
                      f"drafter {folder!r} has vocab_size {config.vocab_size}, the request's "
                      f"target has {request.vocab_size}"),
        Verdict.check(request.num_speculative_tokens <= config.block_size,
                      f"drafter {folder!r} drafts blocks of {config.block_size} tokens, the "
                      f"request asks {request.num_speculative_tokens}"),
    )


class DFlash2Proposer(Proposer):
    """DFlash2: drafts a block of k tokens in one pass from several target layers' hidden
    states, then picks the block's path through each slot's top-c candidates.

    Its draft distribution is top-c (c = the drafter's ``num_candidates``): per slot, the
    candidate ids and the selector's conditional probabilities given the drafted prefix
    (one-hot at the drafted token when ``temperature == 0``). Needs ``set_context`` before
    each ``propose`` (see the module docstring; provisional).
    """

    name: ClassVar[str] = "dflash2"
    api_version: ClassVar[str] = "1.0"
    priority: ClassVar[int] = 10
    summary: ClassVar[str] = ("DFlash2 block drafter (dynamic conv + Viterbi candidate selector) "
                              "from target hidden states, any device")

    @classmethod
    def can_implement(cls, request: ProposerRequest, device: DeviceCapability) -> Verdict:
        del device  # plain torch: any device
        if request.method != "dflash2":
            return Verdict.handles(False, f"implements method 'dflash2', request asks "
                                          f"{request.method!r}")
        return Verdict.all(
            Verdict.check(request.num_speculative_tokens >= 1,
                          f"needs num_speculative_tokens >= 1, got "
                          f"{request.num_speculative_tokens}"),
            drafter_verdict(request),
        )

    def __init__(self, request: ProposerRequest, *, temperature: float = 0.0, seed: int = 0,
                 device: torch.device | str = "cpu",
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(request)
        verdict = drafter_verdict(request)
        if not verdict:
            raise ValueError(f"{self.name}: {verdict.reason}")
        from kernelbay_spec_dflash2.drafter import load_drafter

        assert request.drafter is not None
        self.drafter: DFlash2Drafter = load_drafter(request.drafter, device, dtype)
        self.config = self.drafter.config
        #: Sampling temperature of the selector (0 = Viterbi path).
        self.temperature = float(temperature)
        self.seed = seed
        self._generator: torch.Generator | None = None
        self._context: list[torch.Tensor] | None = None

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        """Indices into the target's hidden-states tuple whose states ``set_context`` wants."""
        return self.config.target_layer_ids

    def draft_logits_spec(self) -> DraftLogitsSpec:
        return DraftLogitsSpec("topc", self.config.num_candidates)

    def set_context(self, hidden_states: Sequence[torch.Tensor]) -> None:
        """Give the target hidden states for the next ``propose`` (one tensor per request).

        Each is ``[L_b, len(target_layer_ids), target_hidden_size]`` or
        ``[L_b, len(target_layer_ids) * target_hidden_size]``; row L_b - 1 belongs to the
        request's last token. Provisional: the engine's speculative loop may pass these
        differently once it lands.
        """
        width = self.config.context_features
        context = []
        for b, states in enumerate(hidden_states):
            flat = states.flatten(-2) if states.dim() == 3 else states
            if flat.dim() != 2 or flat.shape[-1] != width:
                raise ValueError(
                    f"{self.name}: context of request {b} has shape {tuple(states.shape)}; "
                    f"expected [L, {len(self.config.target_layer_ids)}, "
                    f"{self.config.target_hidden_size}] or [L, {width}]")
            context.append(flat)
        self._context = context

    def propose(self, token_ids: Sequence[torch.Tensor], out: DraftBuffers) -> None:
        import torch

        context, self._context = self._context, None
        if context is None:
            raise RuntimeError(f"{self.name}: propose() needs the target's hidden states; call "
                               "set_context(hidden_states) before each propose()")
        if len(context) != len(token_ids):
            raise ValueError(f"{self.name}: set_context got {len(context)} requests, propose "
                             f"got {len(token_ids)}")
        k = out.tokens.shape[1]
        c = self.config.num_candidates
        if out.candidate_ids is None or out.candidate_probs is None:
            raise ValueError(f"{self.name}: needs top-c buffers (DraftLogitsSpec('topc', {c})), "
                             "got buffers without candidate_ids/candidate_probs")
        if out.candidate_ids.shape[1:] != (k, c) or k > self.config.block_size:
            raise ValueError(f"{self.name}: buffers hold [B, {k}, "
                             f"{out.candidate_ids.shape[-1]}] candidates; the drafter gives "
                             f"at most {self.config.block_size} slots of {c}")
        out.tokens.zero_()
        out.num_drafted.zero_()
        out.candidate_ids.zero_()
        out.candidate_probs.zero_()
        rows = [b for b, t in enumerate(token_ids) if t.numel() > 0]
        if not rows:
            return
        empty = [b for b in rows if context[b].shape[0] == 0]
        if empty:
            raise ValueError(f"{self.name}: requests {empty} have tokens but no context rows")
        device = context[rows[0]].device
        if next(self.drafter.parameters()).device != device:
            self.drafter.to(device)
        window = min(self.config.context_window, max(context[b].shape[0] for b in rows))
        feats = torch.zeros(len(rows), window, self.config.context_features, device=device,
                            dtype=context[rows[0]].dtype)
        mask = torch.zeros(len(rows), window, dtype=torch.bool, device=device)
        for i, b in enumerate(rows):
            rows_b = context[b][-window:]
            feats[i, window - rows_b.shape[0]:] = rows_b.to(device)   # right-aligned
            mask[i, window - rows_b.shape[0]:] = True
        anchor = torch.stack([token_ids[b][-1] for b in rows]).to(device).long()
        picked = self.drafter.draft(anchor, feats, mask, num_tokens=k,
                                    temperature=self.temperature,
                                    generator=self._generator_on(device))
        index = torch.tensor(rows, device=out.tokens.device)
        out.tokens[index] = picked.tokens.to(out.tokens)
        out.candidate_ids[index] = picked.candidate_ids.to(out.candidate_ids)
        out.candidate_probs[index] = picked.candidate_probs.to(out.candidate_probs)
        out.num_drafted[index] = k

    def _generator_on(self, device: torch.device) -> torch.Generator | None:
        import torch

        if self.temperature == 0:
            return None
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device).manual_seed(self.seed)
        return self._generator
