"""FP8 E4M3 with fp32 scales: one per tensor, or one per (default 128 x 128) tile of [N, K].

Math
----
    scale = amax(|x|) / 448            over the tensor, or over each tile
    scale = 1.0 where amax == 0        (all-zero tensor or tile: no 0/0)
    q     = e4m3(x / scale)            clamped to ±448, round to nearest even, in float32
    x'    = float(q) * scale

Tiles cover the last two dimensions [N, K] (leading dimensions are batch, e.g. MoE experts);
the scale grid is ``[ceil(N / bn), ceil(K / bk)]``. Ragged edges are allowed: a partial tile
at the end of N or K gets the amax of the elements it actually has.

ModelOpt's FP8 exporter divides a bf16 weight by the scale in bf16 before the cast, so a few
percent of its codes differ by one ulp from this float32 reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kernelbay.formats.division import divide
from kernelbay.formats.e4m3 import E4M3_MAX, to_e4m3

__all__ = [
    "FP8_BLOCK",
    "dequantize_fp8_per_block",
    "dequantize_fp8_per_tensor",
    "quantize_fp8_per_block",
    "quantize_fp8_per_tensor",
]

FP8_BLOCK = (128, 128)
"""The default FP8 per-block tile, (rows of N, columns of K)."""


def _scale(amax: Tensor) -> Tensor:
    s = divide(amax.float(), E4M3_MAX)
    return torch.where(amax == 0, 1.0, s)


def quantize_fp8_per_tensor(x: Tensor) -> tuple[Tensor, Tensor]:
    """Quantize ``x`` to ``float8_e4m3fn`` with one fp32 scale ``amax / 448`` (shape [])."""
    xf = x.float()
    scale = _scale(xf.abs().amax())
    return to_e4m3(xf / scale), scale


def dequantize_fp8_per_tensor(
    q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32
) -> Tensor:
    """``float(q) * scale`` in float32, returned in ``dtype``."""
    return (q.float() * scale.float()).to(dtype)


def _check_2d(x: Tensor, block: tuple[int, int], who: str) -> None:
    if x.dim() < 2:
        raise ValueError(f"{who} wants [..., N, K], got shape {tuple(x.shape)}")
    if len(block) != 2 or min(block) <= 0:
        raise ValueError(f"{who}: block must be two positive sizes (bn, bk), got {block!r}")


def _expand(scales: Tensor, block: tuple[int, int], n: int, k: int) -> Tensor:
    bn, bk = block
    full = scales.repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)
    return full[..., :n, :k]


def quantize_fp8_per_block(x: Tensor, block: tuple[int, int] = FP8_BLOCK) -> tuple[Tensor, Tensor]:
    """Quantize ``x [..., N, K]`` to ``float8_e4m3fn`` with one fp32 scale per ``block`` tile.

    Returns ``(q [..., N, K], scales [..., ceil(N/bn), ceil(K/bk)])``; partial edge tiles get
    their own amax.
    """
    _check_2d(x, block, "quantize_fp8_per_block")
    bn, bk = block
    xf = x.float()
    n, k = xf.shape[-2:]
    nb, kb = -(-n // bn), -(-k // bk)
    padded = F.pad(xf.abs(), (0, kb * bk - k, 0, nb * bn - n))  # zeros never raise an amax
    tiles = padded.reshape(*xf.shape[:-2], nb, bn, kb, bk)
    scales = _scale(tiles.amax(dim=(-3, -1)))
    return to_e4m3(xf / _expand(scales, block, n, k)), scales


def dequantize_fp8_per_block(
    q: Tensor,
    scales: Tensor,
    block: tuple[int, int] = FP8_BLOCK,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """``float(q) * scale`` of each element's tile, in float32, returned in ``dtype``."""
    _check_2d(q, block, "dequantize_fp8_per_block")
    n, k = q.shape[-2:]
    want = (*q.shape[:-2], -(-n // block[0]), -(-k // block[1]))
    if tuple(scales.shape) != want:
        raise ValueError(
            f"dequantize_fp8_per_block: scales have shape {tuple(scales.shape)}, want {want}"
        )
    return (q.float() * _expand(scales.float(), block, n, k)).to(dtype)
