"""What every causal LM family shares: the decoder loop, the LM head, ignored tensors."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kernelbay.checkpoint.layout import beyond_layers
from kernelbay.engine.build import ModelBuilder
from kernelbay.engine.modules import ForwardMeta, Linear, vocab_logits
from kernelbay.engine.rope import Rope

__all__ = ["CausalLM"]


class CausalLM(nn.Module):
    """A decoder-only LM: ``self.model`` holds ``embed_tokens``, ``layers`` (each called as
    ``layer(x, rope, cos, sin, meta)``) and ``norm``; ``self.lm_head`` is the head's
    ``Linear`` or ``None`` when tied to the embedding; ``self.rope`` the rotary embedding."""

    model: Any
    lm_head: Linear | None
    rope: Rope

    def build_head(self, b: ModelBuilder) -> None:
        """The LM head, unless the checkpoint ties it to the embedding (and omits it)."""
        c = b.config
        tied = bool(c.tie_word_embeddings) and not b.has_linear("lm_head")
        self.lm_head = None if tied else b.linear("lm_head", c.hidden_size or 0,
                                                  c.vocab_size or 0)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: ForwardMeta) -> torch.Tensor:
        """Hidden states [T, hidden] of the packed tokens ``input_ids`` [T]."""
        return self.forward_capturing(input_ids, positions, meta, ())[0]

    def forward_capturing(self, input_ids: torch.Tensor, positions: torch.Tensor,
                          meta: ForwardMeta, layers: tuple[int, ...]
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``forward``, plus the states of ``layers`` [T, len(layers), hidden] (None when
        empty): 0 the embeddings, i the output of decoder layer i, and the last layer's
        index after the final norm (Hugging Face's ``output_hidden_states`` convention)."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope.cos_sin(positions, x.dtype)
        count = len(self.model.layers)
        taken: dict[int, torch.Tensor] = {0: x} if 0 in layers else {}
        for index, layer in enumerate(self.model.layers, start=1):
            x = layer(x, self.rope, cos, sin, meta)
            if index in layers and index < count:
                taken[index] = x
        hidden: torch.Tensor = self.model.norm(x)
        if count in layers:
            taken[count] = hidden
        if not layers:
            return hidden, None
        return hidden, torch.stack([taken[i] for i in layers], dim=1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] of the selected hidden states."""
        return vocab_logits(hidden, self.lm_head, self.model.embed_tokens)

    @staticmethod
    def ignored_tensor(name: str, config: Any) -> bool:
        """Checkpoint tensors no family reads (``kernelbay.checkpoint.layout.beyond_layers``)."""
        return beyond_layers(name, getattr(config, "num_hidden_layers", None))
