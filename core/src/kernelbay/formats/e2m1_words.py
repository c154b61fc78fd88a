"""The repacked E2M1 word layout that GPU kernels decode in registers (the NVFP4 and MXFP4
plugins' ``repacked`` and ``fragment`` kernels): eight codes per int32 word placed so that
the decode takes eight integer instructions per word (a mask for the first two elements, a
rotation and a mask for each of the next two pairs, a mask, a multiply and a mask for the
last pair), where the checkpoint's nibble order needs about twice as many and a permutation
of the activations. One table (``word_bit_positions``) serves both directions and every
kernel.

Element ``e`` (0..7) of a word sits in register ``r = e // 2`` (one bf16x2 register of the
decoded tile), half ``h = e % 2``. The decode wants each lane as bf16 bits ``s`` at 15 and
``e1 e0 m`` at 8..6 (the lane then reads as ``e2m1 * 2^-126``), i.e. ``LANE_MASK =
0x81C081C0`` over the 32-bit register:

* register 0 is the word under the mask;
* registers 1 and 2 are the word rotated left by ``LANE_ROTATIONS`` (13 and 10 bits) under
  the mask. A rotation is one funnel-shift instruction, and its wrap-around is what lets
  three registers' sources leave the last pair's bits in a form one multiply can gather:
  with plain shifts only 0, 3 and 6 fit, and the leftover bits needed three shifts and three
  masks (the previous layout);
* register 3 gathers the eight bits left over (``GATHER_MASK``) with one multiply by
  ``GATHER_MULTIPLIER = 2^3 + 2^8 + 2^14`` (three shifted copies added: each source bit
  reaches its target through exactly one copy, and the other copies' bits and their carries
  stay outside the mask, which the tests check for all 256 patterns) under the mask.

Two K orders (``ORDERS``) say which eight elements a word holds:

* ``"k"``: elements ``8q .. 8q + 7`` in word ``q`` (the kernels whose decoded tile is the MMA
  operand of a Triton ``kWidth = 8`` layout, which keeps eight consecutive K per thread);
* ``"fragment"``: in each group of 32 elements (four words), word ``c`` holds the eight
  elements one thread of a 16-bit MMA fragment reads over two k16 steps: ``2c, 2c + 1,
  2c + 8, 2c + 9`` and the same plus 16 (``fragment_k_order``). A kernel that keeps the
  decoded weight as the register operand of an sm_90 ``wgmma`` (``kWidth = 2``) decodes a
  word straight into the registers it multiplies, while the activations stay in shared
  memory in their natural order. Needs K to be a multiple of 32.

The layout is a permutation inside each word (``"k"``) or each 16-byte group (``"fragment"``):
same bytes, same size as the checkpoint's ``[N, K/2]`` uint8 tensor, as int32 ``[N, K/8]``
(``"k"``) or ``[N, K/32, 4]`` (``"fragment"``: one row of four words per group, so the shape
says the order and ``words_order`` reads it back); rows stay rows, so tensor-parallel shards
and block scales are untouched (repacking happens after sharding).
"""

from __future__ import annotations

import torch

__all__ = ["GATHER_MASK", "GATHER_MULTIPLIER", "LANE_MASK", "LANE_ROTATIONS", "ORDERS",
           "checkpoint_layout", "fragment_k_order", "repack_e2m1_words", "unpack_e2m1_words",
           "word_bit_positions", "words_order"]

#: The K orders of the repacked words (see the module docstring).
ORDERS = ("k", "fragment")
#: Each decoded register keeps these bits: the sign at 15 and ``e1 e0 m`` at 8..6 of both
#: 16-bit lanes.
LANE_MASK = 0x81C081C0
#: The left rotations of a word that give registers 0, 1 and 2 under ``LANE_MASK``.
LANE_ROTATIONS = (0, 13, 10)
#: Register 3 is ``((word & GATHER_MASK) * GATHER_MULTIPLIER) & LANE_MASK`` (32-bit product).
GATHER_MASK = 0x001B001B
GATHER_MULTIPLIER = (1 << 3) | (1 << 8) | (1 << 14)
#: Register 3's source bits (sign, e1, e0, m) in the low lane (the high lane's: plus 16), which
#: the multiplier's copies shifted by 14, 8, 3 and 3 put on 15, 8, 7 and 6.
_GATHER_SOURCES = (1, 0, 4, 3)


def word_bit_positions() -> tuple[tuple[int, int, int, int], ...]:
    """For element e = 0..7 of a word: bit positions (sign, e1, e0, m) in the int32 word."""
    out: list[tuple[int, int, int, int]] = []
    for e in range(8):
        reg, half = divmod(e, 2)
        base = 16 * half
        if reg == 3:
            sign, e1, e0, m = (p + base for p in _GATHER_SOURCES)
        else:  # the bits that rotating left by LANE_ROTATIONS[reg] moves onto the targets
            sign, e1, e0, m = ((t + base - LANE_ROTATIONS[reg]) % 32 for t in (15, 8, 7, 6))
        out.append((sign, e1, e0, m))
    return tuple(out)


#: Rows repacked per step: the temporaries are a few word-sized tensors of this many rows, so
#: a stack of large experts repacks in bounded memory.
_ROWS_PER_STEP = 4096


def fragment_k_order() -> tuple[int, ...]:
    """For position ``p`` (word ``p // 8``, element ``p % 8``) of a 32-element group in the
    ``"fragment"`` order: the element's K offset in the group."""
    return tuple(16 * (e // 4) + 8 * ((e // 2) % 2) + 2 * c + e % 2
                 for c in range(4) for e in range(8))


def _check_packed(packed: torch.Tensor, order: str) -> None:
    """``ValueError`` naming ``repack_e2m1_words`` unless ``order`` is one of ``ORDERS`` and
    ``packed`` is uint8 [N, K/2] with K a multiple of 8 (of 32 for ``"fragment"``)."""
    if order not in ORDERS:
        raise ValueError(f"repack_e2m1_words: order={order!r}; valid: {ORDERS}")
    k = 32 if order == "fragment" else 8
    if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] % (k // 2):
        raise ValueError(f"repack_e2m1_words: expected uint8 [N, K/2] with K a multiple of {k} "
                         f"(order {order!r}), got {packed.dtype} {tuple(packed.shape)}")


def words_order(words: torch.Tensor) -> str:
    """The K order of repacked words, from their shape: int32 [N, K/8] is ``"k"``, int32
    [N, K/32, 4] ``"fragment"`` (``ValueError`` naming both otherwise)."""
    if words.dtype == torch.int32 and words.dim() == 2:
        return "k"
    if words.dtype == torch.int32 and words.dim() == 3 and words.shape[-1] == 4:
        return "fragment"
    raise ValueError(f"unpack_e2m1_words: expected int32 [N, K/8] (order 'k') or int32 "
                     f"[N, K/32, 4] (order 'fragment'), got {words.dtype} "
                     f"{tuple(words.shape)}")


def _permute_groups(packed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """uint8 ``[R, K/2]`` -> the same codes with each 32-element group read at ``index``."""
    r, half_k = packed.shape
    codes = torch.stack((packed & 15, packed >> 4), -1).reshape(r, half_k // 16, 32)
    codes = codes[:, :, index].reshape(r, half_k, 2)
    return codes[:, :, 0] | (codes[:, :, 1] << 4)


def repack_e2m1_words(packed: torch.Tensor, order: str = "k") -> torch.Tensor:
    """Checkpoint layout uint8 ``[N, K/2]`` (element 2i in the low nibble of byte i) ->
    repacked int32 words in K ``order`` (``ORDERS``): ``[N, K/8]`` for ``"k"`` (K a multiple
    of 8), ``[N, K/32, 4]`` for ``"fragment"`` (K a multiple of 32)."""
    _check_packed(packed, order)
    n, half_k = packed.shape
    index = torch.tensor(fragment_k_order(), device=packed.device)
    out = torch.empty(n, half_k // 4, dtype=torch.int32, device=packed.device)
    table = word_bit_positions()
    for r0 in range(0, n, _ROWS_PER_STEP):
        rows = packed[r0:r0 + _ROWS_PER_STEP]
        if order == "fragment":
            rows = _permute_groups(rows, index)
        nibbles = rows.reshape(-1, half_k // 4, 4)
        word = torch.zeros(nibbles.shape[:2], dtype=torch.int64, device=packed.device)
        for e, positions in enumerate(table):  # element e: nibble e % 2 of byte e // 2
            code = (nibbles[:, :, e // 2].to(torch.int64) >> (4 * (e % 2))) & 15
            for bit, at in zip((3, 2, 1, 0), positions, strict=True):
                word |= ((code >> bit) & 1) << at
        out[r0:r0 + _ROWS_PER_STEP] = torch.where(word >= 2**31, word - 2**32, word)
    return out.reshape(n, -1, 4) if order == "fragment" else out


def unpack_e2m1_words(words: torch.Tensor) -> torch.Tensor:
    """The inverse of ``repack_e2m1_words``: int32 words in either order (``words_order``)
    -> uint8 ``[N, K/2]``."""
    order = words_order(words)
    words = words.reshape(words.shape[0], -1)
    n, q = words.shape
    inverse = torch.argsort(torch.tensor(fragment_k_order(), device=words.device))
    out = torch.empty(n, q, 4, dtype=torch.uint8, device=words.device)
    table = word_bit_positions()
    for r0 in range(0, n, _ROWS_PER_STEP):
        w = words[r0:r0 + _ROWS_PER_STEP].to(torch.int64) & 0xFFFFFFFF
        byte = torch.zeros(*w.shape, 4, dtype=torch.int64, device=words.device)
        for e, positions in enumerate(table):
            code = sum(((w >> at) & 1) << bit
                       for bit, at in zip((3, 2, 1, 0), positions, strict=True))
            byte[:, :, e // 2] |= code << (4 * (e % 2))
        rows = byte.to(torch.uint8).reshape(-1, q * 4)
        if order == "fragment":
            rows = _permute_groups(rows, inverse)
        out[r0:r0 + _ROWS_PER_STEP] = rows.reshape(-1, q, 4)
    return out.reshape(n, q * 4)


def checkpoint_layout(weight: torch.Tensor) -> torch.Tensor:
    """A packed E2M1 weight as the checkpoint holds it (uint8 [N, K/2]), whether a method
    stored it so or repacked (int32 words of ``repack_e2m1_words`` in either order): what the
    references decode."""
    return unpack_e2m1_words(weight) if weight.dtype == torch.int32 else weight
