# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# (Triton kernels are written in its untyped DSL.)
"""A Triton helper for kernels that store bf16: float32 -> bf16 bits, rounded to nearest
even, as a GPU's conversion rounds. Triton's interpreter converts to bf16 by truncation, so
kernels tested there store these bits (as int16) instead. Imports triton: only kernel modules
import this.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["bf16_bits_rne"]


@triton.jit
def bf16_bits_rne(v):
    """float32 -> bf16 bits (int16), round to nearest even, NaN kept (quiet)."""
    bits = v.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(v != v, (bits >> 16) | 0x40, rounded).to(tl.int16)
