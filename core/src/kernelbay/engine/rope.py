"""Rotary position embeddings: inverse frequencies for each scaling type, and their application.

Scaling types follow the Hugging Face config field ``rope_type``: ``default``, ``linear``,
``dynamic`` (treated as default within the original context), ``llama3`` and ``yarn``
(DeepSeek-V3). ``attention_factor`` multiplies cos and sin, as the reference does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, final

import torch

__all__ = ["Rope", "rope_from_config"]


def _default(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    factor = float(p["factor"])
    low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old_context = float(p["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(base: float, dim: int, p: dict[str, Any], max_positions: int
          ) -> tuple[torch.Tensor, float]:
    factor = float(p["factor"])
    mscale, mscale_all = p.get("mscale"), p.get("mscale_all_dim")
    original = int(p.get("original_max_position_embeddings") or max_positions)
    if p.get("original_max_position_embeddings") and "factor" not in p:
        factor = max_positions / original
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = float(p.get("beta_fast") or 32), float(p.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


@final
@dataclass
class Rope:
    """Precomputed inverse frequencies; ``interleaved`` pairs (x0, x1), (x2, x3) as DeepSeek
    does, else the halves (x[:d/2], x[d/2:]) as Llama does."""

    inv_freq: torch.Tensor
    attention_factor: float = 1.0
    interleaved: bool = False

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor,
                                                                            torch.Tensor]:
        """cos and sin [T, dim] for ``positions`` [T], in ``dtype`` (computed in float32)."""
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_factor
        sin = emb.sin() * self.attention_factor
        return cos.to(dtype), sin.to(dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` [T, heads, dim] by the per-token ``cos``/``sin`` [T, dim]."""
        cos, sin = cos[:, None, :], sin[:, None, :]
        if self.interleaved:
            half = x.shape[-1] // 2
            c, s = cos[..., :half], sin[..., :half]
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


def rope_from_config(dim: int, base: float, scaling: dict[str, Any] | None,
                     max_positions: int, interleaved: bool = False) -> Rope:
    """Build the rope of a head dim ``dim`` from a config's scaling dict (or ``None``)."""
    inv_freq = _default(base, dim)
    if not scaling:
        return Rope(inv_freq, 1.0, interleaved)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("default", "dynamic"):
        return Rope(inv_freq, 1.0, interleaved)
    if kind == "linear":
        return Rope(inv_freq / float(scaling["factor"]), 1.0, interleaved)
    if kind == "llama3":
        return Rope(_llama3(inv_freq, scaling), 1.0, interleaved)
    if kind == "yarn":
        yarn_freq, factor = _yarn(base, dim, scaling, max_positions)
        return Rope(yarn_freq, factor, interleaved)
    raise ValueError(f"rope_type {kind!r} is not supported; supported: default, dynamic, "
                     "linear, llama3, yarn")
