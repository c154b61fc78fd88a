"""Block-scale codes: the NVFP4 E4M3 block scales re-encoded once after loading so that the
GPU decode turns a scale into its bf16 multiplier with one integer multiply-add.

The fused kernels multiply two decoded lanes (bf16 ``e2m1 * 2^-126``) by the bf16 multiplier
``S * 2^118`` of their block (``triton_halfword``). From an E4M3 byte that multiplier costs
about five instructions (fp16 bit pattern, widening, a multiply, a rounding pack), and in the
transposed kernel every thread needs 32 of them per K tile. The multipliers of the finite
E4M3 values are few and regular: for ``S > 0`` the bf16 bits of ``S * 2^118`` are
``e << 7 | m << 4`` with exponent field ``e`` in 236..253 and a 3-bit mantissa ``m``
(subnormal ``S`` included: ``m * 2^-9`` is a normal bf16 after the shift). So the code
``r = (e - 236) << 3 | m`` (0..142, one byte) gives the multiplier as ``r * 16 + 0x7600``.
The CUDA and Triton decodes put two codes in the two 16-bit halves of one register (one byte
permute) and make both blocks' multipliers with one multiply-add (``x * 16 + 0x76007600``);
each packed ``fma.rn.bf16x2`` takes its block's half broadcast to both lanes through an
operand swizzle of the multiply (``.H0_H0`` / ``.H1_H1``), which costs no instruction.

A code has no sign and no zero, so ``fold_block_scales`` moves both into the E2M1 codes
first, exactly: a block with a negative scale gets every code's sign flipped and ``|S|``
(``e2m1(c ^ 8) * |S| == e2m1(c) * S``, signed zeros included), a block with a zero scale gets
its codes' magnitudes cleared (the sign kept, flipped for ``-0``) and the scale 1.0. The
folded weight dequantizes through the reference to the same values, bit for bit.
"""

from __future__ import annotations

import torch

__all__ = ["MULTIPLIER_BIAS", "codes_to_e4m3", "e4m3_to_codes", "fold_block_scales"]

#: bf16 bits of the multiplier of code r: ``r * 16 + MULTIPLIER_BIAS`` (exponent field 236).
MULTIPLIER_BIAS = 236 << 7

_FIRST_EXPONENT = 236
_SHIFT = 2.0**118


def e4m3_to_codes(scales: torch.Tensor) -> torch.Tensor:
    """Positive finite E4M3 block scales -> uint8 codes (``ValueError`` naming the count of
    scales that are not, which ``fold_block_scales`` removes first)."""
    s = scales.float()
    bad = int(((s <= 0) | ~torch.isfinite(s)).sum())
    if bad:
        raise ValueError(f"e4m3_to_codes: {bad} block scale(s) of {s.numel()} are not "
                         "positive finite E4M3 values (fold_block_scales folds signs and zeros "
                         "into the codes first)")
    bits = (s * _SHIFT).to(torch.bfloat16).view(torch.int16).to(torch.int32)
    return ((bits >> 4) - (_FIRST_EXPONENT << 3)).to(torch.uint8)


def codes_to_e4m3(codes: torch.Tensor) -> torch.Tensor:
    """The inverse of ``e4m3_to_codes``: uint8 codes -> float8_e4m3fn scales."""
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes_to_e4m3: expected uint8 scale codes, got {codes.dtype}")
    bits = (codes.to(torch.int32) * 16 + MULTIPLIER_BIAS).to(torch.int16)
    return (bits.view(torch.bfloat16).float() / _SHIFT).to(torch.float8_e4m3fn)


def fold_block_scales(packed: torch.Tensor, scales: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint codes uint8 [..., K/2] and E4M3 block scales [..., K/16] -> (codes with the
    scales' signs and zeros folded in, uint8 scale codes): the same dequantized values."""
    if scales.dtype != torch.float8_e4m3fn or packed.dtype != torch.uint8 \
            or packed.shape[:-1] != scales.shape[:-1] or packed.shape[-1] != 8 * scales.shape[-1]:
        raise ValueError(f"fold_block_scales: expected uint8 codes [..., K/2] and "
                         f"float8_e4m3fn scales [..., K/16], got {packed.dtype} "
                         f"{tuple(packed.shape)} and {scales.dtype} {tuple(scales.shape)}")
    bits = scales.view(torch.uint8)
    negative = (bits & 0x80) != 0
    zero = (bits & 0x7F) == 0
    # per byte of codes (two elements), its block's flags
    flip = negative.repeat_interleave(8, dim=-1)
    clear = zero.repeat_interleave(8, dim=-1)
    sign_bits = torch.where(flip, 0x88, 0).to(torch.uint8)
    folded = torch.where(clear, packed & 0x88, packed) ^ sign_bits
    positive = torch.where(zero, torch.ones_like(scales, dtype=torch.float32),
                           scales.float().abs()).to(torch.float8_e4m3fn)
    return folded, e4m3_to_codes(positive)
