"""E8M0 (``float8_e8m0fnu``): the unsigned power-of-two block scale of the OCP MX formats.

Math
----
A byte ``b`` is the scale 2^(b - 127); ``b = 255`` is NaN; there is no zero, no sign and no
mantissa. ``encode_e8m0`` takes an integer (unbiased) exponent ``X`` and stores
``clamp(X + 127, 0, 254)``: it never produces NaN, so a caller that wants a NaN scale writes
255 itself. ``b = 0`` decodes to 2^-127, an fp32 subnormal (exact).

Unlike ``ml_dtypes``'s float -> E8M0 cast (which rounds a float to a power of two, maps 0 and
overflow to NaN), this encoder takes exponents: the scale rule lives in ``mx.py``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["E8M0_BIAS", "E8M0_NAN", "decode_e8m0", "encode_e8m0"]

E8M0_BIAS = 127
"""The E8M0 exponent bias."""

E8M0_NAN = 255
"""The E8M0 NaN byte."""


def encode_e8m0(exponent: Tensor) -> Tensor:
    """Bias an integer exponent tensor and clamp it to the finite bytes: uint8 in [0, 254]."""
    if exponent.is_floating_point() or exponent.is_complex():
        raise TypeError(f"encode_e8m0 wants an integer exponent tensor, got dtype {exponent.dtype}")
    return (exponent.long() + E8M0_BIAS).clamp(0, E8M0_NAN - 1).to(torch.uint8)


def decode_e8m0(scale: Tensor) -> Tensor:
    """E8M0 bytes (uint8) to float32 scales 2^(b - 127); 255 gives NaN."""
    if scale.dtype != torch.uint8:
        raise TypeError(f"decode_e8m0 wants uint8 bytes, got dtype {scale.dtype}")
    value = torch.exp2(scale.double() - E8M0_BIAS).float()  # exact: 2^-127 .. 2^127
    return torch.where(scale == E8M0_NAN, torch.nan, value)
