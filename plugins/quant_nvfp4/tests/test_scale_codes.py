"""Scale codes: the E4M3 block scales re-encoded for a one multiply-add multiplier, with their
signs and zeros folded into the E2M1 codes, exact through the reference."""

from __future__ import annotations

import pytest
import torch
from kernelbay.formats import dequantize_nvfp4
from kernelbay_quant_nvfp4.scale_codes import (
    MULTIPLIER_BIAS,
    codes_to_e4m3,
    e4m3_to_codes,
    fold_block_scales,
)

FINITE = [b for b in range(256) if b & 0x7F != 0x7F]


def _scales(bits: list[int]) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.uint8).view(torch.float8_e4m3fn)


def test_every_positive_scale_round_trips_and_gives_its_multiplier() -> None:
    """Every positive finite E4M3 value (normals and subnormals): its code is one byte, the
    code's multiplier ``r * 16 + MULTIPLIER_BIAS`` is the bf16 of ``S * 2^118`` (computed here
    in float64), and the code decodes back to the same E4M3 bits."""
    bits = [b for b in range(1, 0x7F)]
    scales = _scales(bits)
    codes = e4m3_to_codes(scales)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 142
    mult = (codes.to(torch.int32) * 16 + MULTIPLIER_BIAS).to(torch.int16).view(torch.bfloat16)
    assert torch.equal(mult.double(), scales.double() * 2.0**118)
    assert torch.equal(codes_to_e4m3(codes).view(torch.uint8), scales.view(torch.uint8))


def test_fold_keeps_every_code_under_every_scale() -> None:
    """Each row: the 16 E2M1 codes under one finite E4M3 scale (signed zeros, subnormals,
    negatives, the largest): folded and decoded through the reference, the same float32 bits
    (the signs of zero products included)."""
    n = len(FINITE)
    codes = torch.arange(16, dtype=torch.uint8).repeat(n, 1)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scales = _scales(FINITE).reshape(n, 1)
    folded, scale_codes = fold_block_scales(packed, scales)
    glob = torch.tensor(0.3)
    want = dequantize_nvfp4(packed, scales, glob)
    got = dequantize_nvfp4(folded, codes_to_e4m3(scale_codes), glob)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    # negative scales flipped the codes' signs, zero scales cleared their magnitudes
    neg = (scales.view(torch.uint8)[:, 0] & 0x80) != 0
    zero = (scales.view(torch.uint8)[:, 0] & 0x7F) == 0
    assert torch.equal(folded[neg & ~zero], packed[neg & ~zero] ^ 0x88)
    assert bool(((folded[zero] & 0x77) == 0).all())


def test_bad_inputs_are_named() -> None:
    with pytest.raises(ValueError, match=r"e4m3_to_codes: 2 block scale\(s\) of 3 are not "
                                         "positive finite"):
        e4m3_to_codes(_scales([0x38, 0x00, 0xB8]))
    with pytest.raises(ValueError, match="codes_to_e4m3: expected uint8 scale codes"):
        codes_to_e4m3(torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"fold_block_scales: expected uint8 codes \[..., K/2\] "
                                         r"and float8_e4m3fn scales \[..., K/16\], got "
                                         r"torch.uint8 \(2, 8\) and torch.float8_e4m3fn \(2, 2\)"):
        fold_block_scales(torch.zeros(2, 8, dtype=torch.uint8),
                          torch.ones(2, 2).to(torch.float8_e4m3fn))
