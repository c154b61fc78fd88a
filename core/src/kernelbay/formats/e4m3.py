"""FP8 E4M3 (``torch.float8_e4m3fn``): block scales of NVFP4, elements of MXFP8 and FP8.

Math
----
1 sign, 4 exponent bits (bias 7), 3 mantissa bits; no Inf; ``S.1111.111`` is NaN. The
largest finite value is 1.75 * 2^8 = 448; subnormals are multiples of 2^-9.

A float -> E4M3 cast rounds to nearest even. Out-of-range values give NaN in some libraries
(``ml_dtypes``: anything above 464, and Inf, becomes NaN; 464 is a tie and goes to 448) and
saturate in others (torch 2.13 eager; 2.11 and older did not), so ``to_e4m3`` clamps to
±448 first: finite and infinite overflow both become ±448 everywhere, NaN stays NaN.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["E4M3_MAX", "e4m3_bits", "from_e4m3_bits", "to_e4m3"]

E4M3_MAX = 448.0
"""The largest finite E4M3 magnitude."""


def to_e4m3(x: Tensor) -> Tensor:
    """Clamp ``x`` to ±448, then cast to ``torch.float8_e4m3fn`` (round to nearest even).

    Inf saturates to ±448; NaN stays NaN.
    """
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def e4m3_bits(x: Tensor) -> Tensor:
    """The raw bytes (uint8) of a ``float8_e4m3fn`` tensor."""
    if x.dtype != torch.float8_e4m3fn:
        raise TypeError(f"e4m3_bits wants a float8_e4m3fn tensor, got dtype {x.dtype}")
    return x.view(torch.uint8)


def from_e4m3_bits(bits: Tensor) -> Tensor:
    """Reinterpret raw bytes (uint8) as a ``float8_e4m3fn`` tensor."""
    if bits.dtype != torch.uint8:
        raise TypeError(f"from_e4m3_bits wants uint8 bytes, got dtype {bits.dtype}")
    return bits.view(torch.float8_e4m3fn)
