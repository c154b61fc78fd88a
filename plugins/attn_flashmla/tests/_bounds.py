"""Per-element error bounds of the MLA record formats (shared by the codec and attention tests).

For one value x, s its group's scale and y = x / s the scaled value:

* bf16 (8 significant bits, round to nearest even): |x' - x| <= 2^-8 |x|.
* E4M3 (3 mantissa bits, exponent bias 7): a normal y in [2^e, 2^(e+1)) has spacing
  2^(e-3), so rounding errs by at most 2^(e-4) <= 2^-4 |y|; below 2^-6 (subnormals, spacing
  2^-9) by at most 2^-10. No clipping: fp32 scales are amax / 448 and E8M0 scales
  (rceil) 2^ceil(log2(amax / 448)) >= amax / 448, so |y| <= 448. In x's units:
  |x' - x| <= 2^-4 |x| + 2^-10 s (the sum covers both regimes), times (1 + 1e-6) for the
  float32 division before the cast.
"""

from __future__ import annotations

import torch
from kernelbay_attn_flashmla.records import MLARecord

__all__ = ["element_bound"]


def element_bound(record: MLARecord, latent: torch.Tensor) -> torch.Tensor:
    """The per-element bound on |decode(encode(x)) - x| stated in the module docstring."""
    x = latent.float().abs()
    rank = record.kv_lora_rank
    if record.kind == "bf16":
        return 2.0**-8 * x
    assert record.group_size is not None
    quantized = x if record.kind == "mxfp8" else x[..., :rank]
    groups = quantized.unflatten(-1, (-1, record.group_size))
    amax = groups.amax(-1, keepdim=True)
    if record.kind == "fp8":
        scale = torch.where(amax == 0, 1.0, amax / 448)
    else:
        scale = torch.exp2(torch.ceil(torch.log2(amax.clamp(min=2.0**-126) / 448)))
    bound = (2.0**-4 * groups + 2.0**-10 * scale).flatten(-2) * (1 + 1e-6)
    if record.kind == "mxfp8":
        return bound
    return torch.cat([bound, 2.0**-8 * x[..., rank:]], dim=-1)
