"""The DFlash2 drafter: one forward pass drafts a block of k tokens.

Data flow for a batch of B requests (D = drafter width, L <= context_window)::

    context  [B, L, n_layers * H_target] -- target hidden states at the chosen layers,
                                            concatenated; the last row is the position just
                                            before the anchor's
      -> Linear + RMSNorm + position-from-the-end embedding          [B, L, D]
    slots    embed(anchor) + slot embedding t                        [B, k, D]
      -> DynamicDepthwiseConv                          (the opening conv of the wrap)
      -> num_layers x [ slots attend to (context + all slots), SwiGLU MLP ]   (pre-norm, residual)
      -> DynamicDepthwiseConv                          (the closing conv)
      -> RMSNorm -> lm_head                                          logits [B, k, vocab]
      -> CandidateSelector                                           tokens [B, k]

Slots see each other in both directions (the block is drafted jointly); the convolutions
carry the left-to-right order within the block. Saved as ``config.json`` +
``model.safetensors`` only (no pickle).
"""

from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F
from torch import nn

from kernelbay_spec_dflash2.config import CONFIG_NAME, WEIGHTS_NAME, DFlash2Config
from kernelbay_spec_dflash2.modules import CandidateSelector, DynamicDepthwiseConv, SelectorOutput

__all__ = ["DFlash2Drafter", "load_drafter", "save_drafter"]


class _Sublayer(nn.Module):
    """Pre-norm attention of the slots over (context + slots), then a SwiGLU MLP."""

    def __init__(self, config: DFlash2Config) -> None:
        super().__init__()
        d = config.hidden_size
        self.num_heads = config.num_heads
        self.attn_norm = nn.RMSNorm(d, eps=config.rms_norm_eps)
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)
        self.mlp_norm = nn.RMSNorm(d, eps=config.rms_norm_eps)
        self.gate_proj = nn.Linear(d, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, d, bias=False)

    def forward(self, x: torch.Tensor, context: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``x`` [B, k, D] slots, ``context`` [B, L, D], ``mask`` [B, 1, 1, L + k] (True = see)."""
        h = self.attn_norm(x)
        kv = torch.cat([context, h], dim=1)

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(*t.shape[:-1], self.num_heads, -1).transpose(1, 2)

        attn = F.scaled_dot_product_attention(heads(self.q_proj(h)), heads(self.k_proj(kv)),
                                              heads(self.v_proj(kv)), attn_mask=mask)
        x = x + self.o_proj(attn.transpose(1, 2).flatten(-2))
        h = self.mlp_norm(x)
        mlp: torch.Tensor = self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
        return x + mlp


class DFlash2Drafter(nn.Module):
    """Drafts a block of ``config.block_size`` tokens from target hidden states in one pass.

    ``forward`` returns the per-slot logits; ``draft`` adds the selector's path. The module
    owns its selector (``self.selector``), so one state dict holds the whole drafter.
    """

    def __init__(self, config: DFlash2Config) -> None:
        super().__init__()
        self.config = config
        d, k = config.hidden_size, config.block_size
        self.context_proj = nn.Linear(config.context_features, d, bias=False)
        self.context_norm = nn.RMSNorm(d, eps=config.rms_norm_eps)
        self.context_pos = nn.Embedding(config.context_window, d)
        self.embed = nn.Embedding(config.vocab_size, d)
        self.slot_embed = nn.Embedding(k, d)
        self.conv_in = DynamicDepthwiseConv(d, k, config.conv_groups)
        self.layers = nn.ModuleList(_Sublayer(config) for _ in range(config.num_layers))
        self.conv_out = DynamicDepthwiseConv(d, k, config.conv_groups)
        self.norm = nn.RMSNorm(d, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(d, config.vocab_size, bias=False)
        self.selector = CandidateSelector(config.vocab_size, config.num_candidates,
                                          config.pair_rank)
        for emb in (self.context_pos, self.embed, self.slot_embed):
            nn.init.normal_(emb.weight, std=0.02)

    def forward(self, anchor: torch.Tensor, context: torch.Tensor,
                context_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Per-slot logits ``[B, k, vocab]``.

        ``anchor`` [B]: the last accepted token of each request (not yet through the target).
        ``context`` [B, L, n_layers * target_hidden] with L <= ``context_window``: target
        features of the latest L positions before the anchor, right-aligned (row L-1 is the
        position just before the anchor's). Slot t predicts the token at anchor + 1 + t.
        ``context_mask`` [B, L] bool, False for left padding; None means all valid.
        """
        c = self.config
        batch, length = anchor.shape[0], context.shape[1]
        if context.shape != (batch, length, c.context_features) or length > c.context_window:
            raise ValueError(f"expected context [{batch}, L <= {c.context_window}, "
                             f"{c.context_features}], got {tuple(context.shape)}")
        if length < 1:
            raise ValueError("context must hold at least one position before the anchor, got L=0")
        if context_mask is None:
            context_mask = torch.ones(batch, length, dtype=torch.bool, device=context.device)
        elif context_mask.shape != (batch, length):
            raise ValueError(f"expected context_mask [{batch}, {length}], got "
                             f"{tuple(context_mask.shape)}")
        dtype = self.context_proj.weight.dtype
        from_end = torch.arange(length - 1, -1, -1, device=context.device)
        ctx = self.context_norm(self.context_proj(context.to(dtype))) + self.context_pos(from_end)
        slots = torch.arange(c.block_size, device=anchor.device)
        x = self.embed(anchor)[:, None, :] + self.slot_embed(slots)[None]
        mask = torch.cat([context_mask.bool(),
                          torch.ones(batch, c.block_size, dtype=torch.bool,
                                     device=context.device)], dim=1)[:, None, None, :]
        x = self.conv_in(x)
        for layer in self.layers:
            x = layer(x, ctx, mask)
        x = self.conv_out(x)
        logits: torch.Tensor = self.lm_head(self.norm(x))
        return logits

    @torch.no_grad()
    def draft(self, anchor: torch.Tensor, context: torch.Tensor,
              context_mask: torch.Tensor | None = None, num_tokens: int | None = None,
              temperature: float = 0.0, generator: torch.Generator | None = None
              ) -> SelectorOutput:
        """Logits, then the selector's path over the first ``num_tokens`` slots (default k)."""
        k = self.config.block_size if num_tokens is None else num_tokens
        if not 1 <= k <= self.config.block_size:
            raise ValueError(f"num_tokens must be in [1, block_size={self.config.block_size}], "
                             f"got {k}")
        logits = self(anchor, context, context_mask)[:, :k]
        picked: SelectorOutput = self.selector(logits, anchor, temperature, generator)
        return picked


def save_drafter(model: DFlash2Drafter, folder: str, dtype: torch.dtype | None = None) -> str:
    """Write ``config.json`` and ``model.safetensors`` (tensors in ``dtype``, default as they
    are) into ``folder``; returns ``folder``."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, CONFIG_NAME), "w", encoding="utf-8") as f:
        f.write(model.config.to_json())
    tensors = {k: v.detach().to(dtype or v.dtype).contiguous().cpu()
               for k, v in model.state_dict().items()}
    save_file(tensors, os.path.join(folder, WEIGHTS_NAME), metadata={"format": "pt"})
    return folder


def load_drafter(folder: str, device: torch.device | str = "cpu",
                 dtype: torch.dtype | None = None) -> DFlash2Drafter:
    """Build a drafter from ``folder`` (``config.json`` + ``model.safetensors``), in eval mode.

    Every tensor must be present with its exact shape; a missing or extra name is an error
    that lists them.
    """
    from safetensors.torch import load_file

    from kernelbay_spec_dflash2.config import read_drafter_config

    config = read_drafter_config(folder)
    model = DFlash2Drafter(config)
    path = os.path.join(folder, WEIGHTS_NAME)
    state = load_file(path)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing or extra:
        raise ValueError(f"{path}: tensors do not match the config in {CONFIG_NAME}: "
                         f"missing {missing[:8]}, unexpected {extra[:8]}")
    shapes = {n: (tuple(state[n].shape), tuple(t.shape)) for n, t in expected.items()
              if state[n].shape != t.shape}
    if shapes:
        raise ValueError(f"{path}: shape mismatch (file, config) for "
                         f"{json.dumps({n: list(map(list, s)) for n, s in shapes.items()})}")
    model.load_state_dict(state, strict=True)
    return model.to(device=device, dtype=dtype).eval()
