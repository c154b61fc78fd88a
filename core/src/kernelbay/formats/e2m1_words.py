"""The repacked E2M1 word layout that GPU kernels decode in registers (the NVFP4 and MXFP4
plugins' ``repacked`` kernels): eight codes per int32 word placed so that the decode is one
mask for the first two elements, one shift and one mask for the next four and three shifts
and three masks for the last two, where the checkpoint's nibble order needs about twice as
many integer instructions and a permutation of the activations. One table
(``word_bit_positions``) serves both directions and every kernel.

Element ``e`` (0..7) of a word sits in register ``r = e // 2`` (one bf16x2 register of the
decoded tile), half ``h = e % 2``. The decode wants each lane as bf16 bits ``s`` at 15 and
``e1 e0 m`` at 8..6 (the lane then reads as ``e2m1 * 2^-126``), i.e. the mask
``0x81C081C0`` over the 32-bit register. Register 0 is the word itself, registers 1 and 2 the
word shifted left by 3 and 6 (the only shifts whose sources do not collide), register 3
collects the 8 bits left over (sign from a left shift by 1, ``m e0`` from a right shift by 4,
``e1`` from a right shift by 5). ``word_bit_positions`` is the table both directions use.

The layout is a permutation of bits inside each word: same bytes, same size as the
checkpoint's ``[N, K/2]`` uint8 tensor viewed as ``[N, K/8]`` int32; rows stay rows, so
tensor-parallel shards and block scales are untouched (repacking happens after sharding).
"""

from __future__ import annotations

import torch

__all__ = ["repack_e2m1_words", "unpack_e2m1_words", "word_bit_positions"]


def word_bit_positions() -> tuple[tuple[int, int, int, int], ...]:
    """For element e = 0..7 of a word: bit positions (sign, e1, e0, m) in the int32 word."""
    out = []
    for e in range(8):
        reg, half = divmod(e, 2)
        base = 16 * half
        if reg == 3:
            sign, e1, m = 14, 13, 10
        else:
            sign, e1, m = 15 - 3 * reg, 8 - 3 * reg, 6 - 3 * reg
        out.append((sign + base, e1 + base, m + 1 + base, m + base))
    return tuple(out)


def _positions(device: torch.device) -> torch.Tensor:
    return torch.tensor(word_bit_positions(), dtype=torch.int64, device=device)  # [8, 4]


def repack_e2m1_words(packed: torch.Tensor) -> torch.Tensor:
    """Checkpoint layout uint8 ``[N, K/2]`` (element 2i in the low nibble of byte i) ->
    repacked int32 ``[N, K/8]``. ``K/2`` must be a multiple of 4."""
    if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] % 4:
        raise ValueError(f"repack_e2m1_words: expected uint8 [N, K/2] with K a multiple of 8, "
                         f"got {packed.dtype} {tuple(packed.shape)}")
    n, half_k = packed.shape
    b = packed.to(torch.int64)
    codes = torch.stack((b & 15, b >> 4), dim=-1).reshape(n, half_k // 4, 8)  # [N, K/8, 8]
    bits = (codes[..., None] >> torch.tensor([3, 2, 1, 0], device=packed.device)) & 1
    word = (bits << _positions(packed.device)).sum(dim=(-1, -2))  # disjoint bits: sum == or
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def unpack_e2m1_words(words: torch.Tensor) -> torch.Tensor:
    """The inverse of ``repack_e2m1_words``: int32 ``[N, K/8]`` -> uint8 ``[N, K/2]``."""
    if words.dtype != torch.int32 or words.dim() != 2:
        raise ValueError(f"unpack_e2m1_words: expected int32 [N, K/8], got {words.dtype} "
                         f"{tuple(words.shape)}")
    n, q = words.shape
    w = words.to(torch.int64) & 0xFFFFFFFF
    bits = (w[:, :, None, None] >> _positions(words.device)) & 1  # [N, K/8, 8, 4]
    codes = (bits << torch.tensor([3, 2, 1, 0], device=words.device)).sum(-1)  # [N, K/8, 8]
    pairs = codes.reshape(n, q * 4, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
