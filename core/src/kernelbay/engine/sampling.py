"""Sampling: greedy, temperature, top-k, top-p, with counter-based Gumbel noise.

A token is drawn as ``argmax(logits / T + g)`` over the allowed tokens, where the Gumbel
noise ``g = -log(-log(u))`` comes from a hash of (seed, position, token id). The draw for a
request therefore never depends on what else is in the batch, and a speculative verifier can
reproduce exactly the draw the plain decoder would have made at the same position.

The hash works on 32-bit words held in int64 tensors; every product stays below 2^63, so the
arithmetic is exact on every device (no reliance on signed overflow).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import final

import torch

from kernelbay.engine.transfer import upload

__all__ = ["SamplingParams", "gumbel_noise", "gumbel_noised_argmax", "sample_tokens"]

_MASK32 = 0xFFFFFFFF


@final
@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request. ``temperature == 0`` is greedy.

    ``seed`` keys the Gumbel noise (same seed, same prompt: same output, whatever the batch).
    ``stop_token_ids`` end a request; ``ignore_eos`` keeps going past them.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        """True when tokens are the plain argmax."""
        return self.temperature == 0


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # (x * c) mod 2^32 from 16-bit halves: each partial product is below 2^48.
    lo = (x & 0xFFFF) * c
    hi = ((x >> 16) * c) & 0xFFFF
    return (lo + (hi << 16)) & _MASK32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    # A 32-bit integer finaliser with good avalanche (xorshift-multiply rounds).
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def gumbel_noise(seed: torch.Tensor, position: torch.Tensor, token_ids: torch.Tensor
                 ) -> torch.Tensor:
    """Gumbel(0, 1) noise [..., V] keyed by per-row ``seed`` and ``position`` ([...] int64)
    and ``token_ids`` ([V] or [..., V] int64). float64 for a faithful tail."""
    seed = seed.long()
    key = _hash32(_hash32(seed & _MASK32) ^ _hash32((seed >> 32) + 0x9E3779B9))
    key = _hash32(key ^ _hash32(position.long() + 0x85EBCA6B))
    h1 = _hash32(key.unsqueeze(-1) ^ _hash32(token_ids.long()))
    h2 = _hash32(h1 + 0x27D4EB2F)
    # 53 random bits: u in (0, 1) strictly, so log(-log(u)) is finite.
    bits = (h1 << 21) | (h2 >> 11)
    u = (bits.double() + 0.5) / float(1 << 53)
    return -torch.log(-torch.log(u))


def _filter(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits outside each row's top-k and top-p nucleus with -inf."""
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)
    keep = ranks[None, :] < k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    before = probs.cumsum(dim=-1) - probs
    keep &= before < top_p[:, None]
    mask = torch.zeros_like(keep).scatter(-1, order, keep)
    return logits.masked_fill(~mask, float("-inf"))


def gumbel_noised_argmax(logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor,
                         position: torch.Tensor, top_k: torch.Tensor | None = None,
                         top_p: torch.Tensor | None = None) -> torch.Tensor:
    """Sample one token per row of ``logits`` [B, V]. Rows with temperature 0 are greedy.

    ``position`` is the sequence position the sampled token will occupy.
    """
    rows, vocab = logits.shape
    logits = logits.float()
    temperature = temperature.to(logits.device)
    greedy = temperature <= 0
    if bool(greedy.all()):
        return logits.argmax(dim=-1)
    temp = torch.where(greedy, 1.0, temperature.float())
    scaled = logits / temp[:, None]
    if top_k is not None or top_p is not None:
        k = top_k if top_k is not None else torch.zeros(rows, dtype=torch.long)
        p = top_p if top_p is not None else torch.ones(rows)
        scaled = _filter(scaled, k.to(logits.device), p.to(logits.device).float())
    token_ids = torch.arange(vocab, device=logits.device)
    noise = gumbel_noise(seed.to(logits.device), position.to(logits.device), token_ids)
    sampled = (scaled.double() + noise).argmax(dim=-1)
    return torch.where(greedy.to(logits.device), logits.argmax(dim=-1), sampled)


def sample_tokens(logits: torch.Tensor, params: list[SamplingParams],
                  positions: list[int]) -> torch.Tensor:
    """Sample one token for each row of ``logits`` with that row's parameters."""
    if all(p.temperature == 0 for p in params):
        return logits.float().argmax(dim=-1)
    on = logits.device  # per-row parameters go where the logits are, copied without a sync
    return gumbel_noised_argmax(
        logits, upload([p.temperature for p in params], torch.float32, on),
        upload([p.seed for p in params], torch.long, on), upload(positions, torch.long, on),
        upload([p.top_k for p in params], torch.long, on),
        upload([p.top_p for p in params], torch.float32, on))
