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

__all__ = ["checkpoint_layout", "repack_e2m1_words", "unpack_e2m1_words", "word_bit_positions"]


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


#: Rows repacked per step: the temporaries are a few word-sized tensors of this many rows, so
#: a stack of large experts repacks in bounded memory.
_ROWS_PER_STEP = 4096


def repack_e2m1_words(packed: torch.Tensor) -> torch.Tensor:
    """Checkpoint layout uint8 ``[N, K/2]`` (element 2i in the low nibble of byte i) ->
    repacked int32 ``[N, K/8]``. ``K/2`` must be a multiple of 4."""
    if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] % 4:
        raise ValueError(f"repack_e2m1_words: expected uint8 [N, K/2] with K a multiple of 8, "
                         f"got {packed.dtype} {tuple(packed.shape)}")
    n, half_k = packed.shape
    out = torch.empty(n, half_k // 4, dtype=torch.int32, device=packed.device)
    table = word_bit_positions()
    for r0 in range(0, n, _ROWS_PER_STEP):
        nibbles = packed[r0:r0 + _ROWS_PER_STEP].reshape(-1, half_k // 4, 4)
        word = torch.zeros(nibbles.shape[:2], dtype=torch.int64, device=packed.device)
        for e, positions in enumerate(table):  # element e: nibble e % 2 of byte e // 2
            code = (nibbles[:, :, e // 2].to(torch.int64) >> (4 * (e % 2))) & 15
            for bit, at in zip((3, 2, 1, 0), positions, strict=True):
                word |= ((code >> bit) & 1) << at
        out[r0:r0 + _ROWS_PER_STEP] = torch.where(word >= 2**31, word - 2**32, word)
    return out


def unpack_e2m1_words(words: torch.Tensor) -> torch.Tensor:
    """The inverse of ``repack_e2m1_words``: int32 ``[N, K/8]`` -> uint8 ``[N, K/2]``."""
    if words.dtype != torch.int32 or words.dim() != 2:
        raise ValueError(f"unpack_e2m1_words: expected int32 [N, K/8], got {words.dtype} "
                         f"{tuple(words.shape)}")
    n, q = words.shape
    out = torch.empty(n, q, 4, dtype=torch.uint8, device=words.device)
    table = word_bit_positions()
    for r0 in range(0, n, _ROWS_PER_STEP):
        w = words[r0:r0 + _ROWS_PER_STEP].to(torch.int64) & 0xFFFFFFFF
        byte = torch.zeros(*w.shape, 4, dtype=torch.int64, device=words.device)
        for e, positions in enumerate(table):
            code = sum(((w >> at) & 1) << bit
                       for bit, at in zip((3, 2, 1, 0), positions, strict=True))
            byte[:, :, e // 2] |= code << (4 * (e % 2))
        out[r0:r0 + _ROWS_PER_STEP] = byte.to(torch.uint8)
    return out.reshape(n, q * 4)


def checkpoint_layout(weight: torch.Tensor) -> torch.Tensor:
    """A packed E2M1 weight as the checkpoint holds it (uint8 [N, K/2]), whether a method
    stored it so or repacked (int32 words, ``repack_e2m1_words``): what the references
    decode."""
    return unpack_e2m1_words(weight) if weight.dtype == torch.int32 else weight
