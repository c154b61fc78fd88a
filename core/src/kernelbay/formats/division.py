"""Division that rounds the same on every device.

torch divides a CUDA tensor by a Python number (or a CPU scalar tensor) as a multiply by the
divisor's reciprocal, which is not correctly rounded when the reciprocal is inexact (1 / 448,
1 / 2688): a reference scale ``amax / 448`` would then differ in its last bit between a CPU
and a GPU run, and from a kernel that divides. A divisor tensor on the dividend's device keeps
torch's IEEE division everywhere.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["divide"]


def divide(x: Tensor, divisor: float) -> Tensor:
    """``x / divisor``, correctly rounded on every device (float32 ``x``)."""
    return x / torch.full_like(x, divisor)
