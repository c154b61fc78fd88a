"""The ``dflash2`` proposer: DFlash2 drafts from the target's hidden states.

It declares its hidden states to the core (``hidden_state_spec``: the drafter's
``target_layer_ids`` over its ``context_window`` latest positions); the engine captures them
during every target forward and passes them to ``propose`` in a ``DraftContext``. The anchor
of a block is each request's last token (not yet through the target); the context rows are
the positions before it. A request whose context is not ready (its prompt has not been
through the target yet) gets no draft that step.

Greedy requests take the selector's Viterbi path; at temperature > 0 each slot is drawn as a
Gumbel-noised argmax over its candidates, with the noise the verifier adds at that position
(``kernelbay.engine.sampling.gumbel_noise`` keyed by the request's seed, the position and the
token id), so a draft is accepted exactly when it is the target's own draw.

Without an explicit drafter folder, the drafter bundled for the kernelbay demo model is used
when the target is that model (``bundled_drafter``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ClassVar

from kernelbay.layers import DraftBuffers, DraftLogitsSpec, Proposer
from kernelbay.layers.proposer import DraftContext, HiddenStateSpec
from kernelbay.requests import ProposerRequest
from kernelbay.verdict import Verdict

from kernelbay_spec_dflash2.config import CONFIG_NAME, WEIGHTS_NAME, read_drafter_config

if TYPE_CHECKING:
    import torch
    from kernelbay.device import DeviceCapability

    from kernelbay_spec_dflash2.drafter import DFlash2Drafter

__all__ = ["BUNDLED_DIR", "DFlash2Proposer", "bundled_drafter", "drafter_verdict"]

#: Drafters shipped with this plugin, one folder each (``demo``: for the kernelbay demo model).
BUNDLED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "drafters")
#: The kernelbay demo model, as a proposer request describes its target.
_DEMO_TARGET = ("deepseek_v3", 256, 288)


def bundled_drafter(request: ProposerRequest) -> str | None:
    """The bundled drafter folder for the request's target: the ``demo`` folder when the target
    is the kernelbay demo model (whether or not its weights are present), else None."""
    if (request.model_type, request.hidden_size, request.vocab_size) == _DEMO_TARGET:
        return os.path.join(BUNDLED_DIR, "demo")
    return None


def resolve_drafter(request: ProposerRequest) -> str | None:
    """``request.drafter``, or the bundled drafter for its target."""
    return request.drafter if request.drafter is not None else bundled_drafter(request)


def drafter_verdict(request: ProposerRequest) -> Verdict:
    """Whether ``request.drafter`` (or the bundled drafter for the request's target) names a
    usable drafter folder."""
    folder = resolve_drafter(request)
    if folder is None:
        return Verdict.reject(f"no drafter weights given: the request's drafter is None and "
                              f"no bundled drafter serves target {request.model_type!r} "
                              f"(hidden {request.hidden_size}, vocab {request.vocab_size}); "
                              f"dflash2 needs a folder with {CONFIG_NAME!r} and "
                              f"{WEIGHTS_NAME!r}")
    if request.drafter is None and not os.path.isfile(os.path.join(folder, WEIGHTS_NAME)):
        return Verdict.reject(f"the bundled drafter for the kernelbay demo model is missing: "
                              f"{os.path.join(folder, WEIGHTS_NAME)!r} (and {CONFIG_NAME!r}) "
                              f"are not installed; train them with tools/train_drafter.py "
                              f"or pass a drafter folder")
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
    (one-hot at the drafted token when greedy). Reads the target hidden states it declares in
    ``hidden_state_spec`` (see the module docstring).
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

    def __init__(self, request: ProposerRequest, *, device: torch.device | str = "cpu",
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(request)
        verdict = drafter_verdict(request)
        if not verdict:
            raise ValueError(f"{self.name}: {verdict.reason}")
        from kernelbay_spec_dflash2.drafter import load_drafter

        folder = resolve_drafter(request)
        assert folder is not None
        #: The drafter folder in use (the request's, or the bundled one).
        self.folder = folder
        self.drafter: DFlash2Drafter = load_drafter(folder, device, dtype)
        self.config = self.drafter.config

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        """The target layers whose hidden states the drafter reads."""
        return self.config.target_layer_ids

    def draft_logits_spec(self) -> DraftLogitsSpec:
        return DraftLogitsSpec("topc", self.config.num_candidates)

    def hidden_state_spec(self) -> HiddenStateSpec:
        return HiddenStateSpec(self.config.target_layer_ids, self.config.context_window)

    def propose(self, token_ids: Sequence[torch.Tensor], out: DraftBuffers,
                context: DraftContext | None = None) -> None:
        import torch

        if context is None or context.hidden_states is None or context.num_hidden is None:
            raise ValueError(f"{self.name}: propose() needs a DraftContext with the target's "
                             f"hidden states at layers {list(self.config.target_layer_ids)} "
                             "(the engine passes it; see Proposer.hidden_state_spec)")
        k = out.tokens.shape[1]
        c = self.config.num_candidates
        if out.candidate_ids is None or out.candidate_probs is None:
            raise ValueError(f"{self.name}: needs top-c buffers (DraftLogitsSpec('topc', {c})), "
                             "got buffers without candidate_ids/candidate_probs")
        if out.candidate_ids.shape[2] != c or k > self.config.block_size:
            raise ValueError(f"{self.name}: buffers hold [B, {k}, "
                             f"{out.candidate_ids.shape[-1]}] candidates; the drafter gives "
                             f"at most {self.config.block_size} slots of {c}")
        states = context.hidden_states
        layers, width = len(self.config.target_layer_ids), self.config.target_hidden_size
        if states.shape[0] != len(token_ids) or tuple(states.shape[2:]) != (layers, width):
            raise ValueError(f"{self.name}: hidden_states has shape {tuple(states.shape)}; "
                             f"expected [{len(token_ids)}, window, {layers}, {width}]")
        batch = len(token_ids)
        out.tokens[:batch].zero_()
        out.num_drafted[:batch].zero_()
        out.candidate_ids[:batch].zero_()
        out.candidate_probs[:batch].zero_()
        # A block is drafted after the anchor (the one token not yet through the target).
        rows = [b for b, t in enumerate(token_ids)
                if int(context.num_hidden[b]) > 0 and int(context.num_cached[b]) == t.numel() - 1]
        if not rows:
            return
        device = states.device
        if next(self.drafter.parameters()).device != device:
            self.drafter.to(device)
        window = min(self.config.context_window, states.shape[1])
        index = torch.tensor(rows, device=device)
        feats = states[index, states.shape[1] - window:].flatten(-2)
        have = context.num_hidden[rows].to(device)
        mask = torch.arange(window, device=device)[None, :] >= (window - have)[:, None]
        anchor = torch.stack([token_ids[b][-1] for b in rows]).to(device).long()
        with torch.no_grad():
            logits = self.drafter(anchor, feats, mask)[:, :k]
            temperature = context.temperature[rows]
            if bool((temperature > 0).any()):
                picked = self.drafter.selector.select_keyed(
                    logits, anchor, temperature,
                    self._keyed_noise(context.seed[rows], [token_ids[b].numel() for b in rows],
                                      k, device))
            else:
                picked = self.drafter.selector(logits, anchor)
        at = index.to(out.tokens.device)
        out.tokens[at] = picked.tokens.to(out.tokens)
        out.candidate_ids[at] = picked.candidate_ids.to(out.candidate_ids)
        out.candidate_probs[at] = picked.candidate_probs.to(out.candidate_probs)
        out.num_drafted[at] = k

    @staticmethod
    def _keyed_noise(seed: torch.Tensor, lengths: list[int], k: int, device: torch.device
                     ) -> Callable[[torch.Tensor], torch.Tensor]:
        """Gumbel noise per candidate [R, k, c], keyed as the verifier keys it: slot t of a
        request of ``n`` tokens lands at position n + t."""
        import torch
        from kernelbay.engine.sampling import gumbel_noise

        slots = torch.arange(k, device=device)
        position = torch.tensor(lengths, device=device)[:, None] + slots[None, :]
        seeds = seed.to(device).long()[:, None].expand(-1, k)

        def noise(ids: torch.Tensor) -> torch.Tensor:
            return gumbel_noise(seeds, position, ids)

        return noise
