"""The repacked E2M1 word layout: a bit permutation of each word (round trip, every bit used
once) and the positions the GPU decodes' masks assume."""

from __future__ import annotations

import pytest
import torch
from kernelbay.formats import (
    GATHER_MASK,
    GATHER_MULTIPLIER,
    LANE_MASK,
    LANE_ROTATIONS,
    checkpoint_layout,
    fragment_k_order,
    repack_e2m1_words,
    unpack_e2m1_words,
    word_bit_positions,
    words_order,
)


def test_positions_use_every_bit_once() -> None:
    flat = [bit for element in word_bit_positions() for bit in element]
    assert sorted(flat) == list(range(32))
    # the portable decode (repacked_codes) reads e0 and m as one two-bit field
    assert all(e0 == m + 1 for _, _, e0, m in word_bit_positions())


def test_registers_read_as_bf16_after_their_rotation() -> None:
    """Registers 0..2 of a word are the word rotated left by LANE_ROTATIONS under LANE_MASK:
    each element's sign lands on bit 15 (+16) and e1 e0 m on bits 8..6."""
    positions = word_bit_positions()
    for e in range(6):
        reg, half = divmod(e, 2)
        moved = tuple((p + LANE_ROTATIONS[reg]) % 32 for p in positions[e])
        assert moved == (15 + 16 * half, 8 + 16 * half, 7 + 16 * half, 6 + 16 * half)


def test_gather_is_exact_for_every_pattern() -> None:
    """Register 3 (one multiply): for all 256 values of the gathered bits, whatever the word's
    other bits, the masked product is exactly the two elements' bits at 15 and 8..6 (the
    shifted copies' other bits and carries never reach the mask)."""
    positions = word_bit_positions()[6:]
    gen = torch.Generator().manual_seed(3)
    noise = torch.randint(0, 2**32, (256,), generator=gen, dtype=torch.int64)
    for v in range(256):
        word, want = int(noise[v]) & ~GATHER_MASK, 0
        for half in (0, 1):
            for i, (at, target) in enumerate(zip(positions[half], (15, 8, 7, 6), strict=True)):
                if (v >> (4 * half + i)) & 1:
                    word |= 1 << at
                    want |= 1 << (target + 16 * half)
        assert ((word & GATHER_MASK) * GATHER_MULTIPLIER) & LANE_MASK & 0xFFFFFFFF == want, v


@pytest.mark.parametrize(("n", "k"), [(1, 8), (5, 64), (33, 272)])
def test_round_trip_and_codes(n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(n * k)
    packed = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    words = repack_e2m1_words(packed)
    assert words.dtype == torch.int32 and words.shape == (n, k // 8)
    assert torch.equal(unpack_e2m1_words(words), packed)
    # element j of row r, read back from its bit positions, is the checkpoint's nibble j
    codes = torch.stack((packed & 15, packed >> 4), -1).reshape(n, k).long()
    w = words.long() & 0xFFFFFFFF
    for j in (0, 3, 6, 7, k - 1):
        bits = word_bit_positions()[j % 8]
        got = sum(((w[:, j // 8] >> p) & 1) << (3 - i) for i, p in enumerate(bits))
        assert torch.equal(got, codes[:, j])


def test_bad_inputs_are_named() -> None:
    with pytest.raises(ValueError, match="expected uint8 \\[N, K/2\\]"):
        repack_e2m1_words(torch.zeros(2, 6, dtype=torch.uint8))
    with pytest.raises(ValueError, match="expected int32"):
        unpack_e2m1_words(torch.zeros(2, 6, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of 32 \\(order 'fragment'\\)"):
        repack_e2m1_words(torch.zeros(2, 8, dtype=torch.uint8), "fragment")
    with pytest.raises(ValueError, match="order='mma'; valid: \\('k', 'fragment'\\)"):
        repack_e2m1_words(torch.zeros(2, 8, dtype=torch.uint8), "mma")
    with pytest.raises(ValueError, match=r"int32 \[N, K/32, 4\] \(order 'fragment'\), got "
                                         r"torch.int32 \(2, 2, 3\)"):
        unpack_e2m1_words(torch.zeros(2, 2, 3, dtype=torch.int32))


def test_fragment_order_is_the_mma_fragment_of_each_thread() -> None:
    """Word c of a 32-element group holds what lane c of a quad reads of a 16-bit MMA
    operand over two k16 steps: in each step the pairs (2c, 2c + 1) and (2c + 8, 2c + 9)."""
    order = fragment_k_order()
    assert sorted(order) == list(range(32))
    for c in range(4):
        step = [2 * c, 2 * c + 1, 2 * c + 8, 2 * c + 9]
        assert list(order[8 * c:8 * c + 8]) == step + [16 + k for k in step]


@pytest.mark.parametrize(("n", "k"), [(1, 32), (7, 96), (3, 512)])
def test_fragment_order_round_trip_and_codes(n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(n + k)
    packed = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    words = repack_e2m1_words(packed, "fragment")
    assert words.shape == (n, k // 32, 4) and words_order(words) == "fragment"
    assert torch.equal(unpack_e2m1_words(words), packed)
    assert torch.equal(checkpoint_layout(words), packed)
    flat = words.reshape(n, -1)  # the same words read in the "k" order
    assert words_order(flat) == "k" and not torch.equal(unpack_e2m1_words(flat), packed)
    codes = torch.stack((packed & 15, packed >> 4), -1).reshape(n, k).long()
    w = flat.long() & 0xFFFFFFFF
    for q in range(k // 8):
        for e in range(8):
            bits = word_bit_positions()[e]
            got = sum(((w[:, q] >> p) & 1) << (3 - i) for i, p in enumerate(bits))
            assert torch.equal(got, codes[:, 32 * (q // 4) + fragment_k_order()[8 * (q % 4) + e]])


def _lanes(word: int) -> list[int]:
    """The GPU decode's integer part on one word, as ``e2m1_words_triton.repacked_lanes``
    computes it, with the constants written out: four 32-bit registers of two bf16 lanes
    each."""
    keep = 0x81C081C0

    def rotl(value: int, by: int) -> int:
        return ((value << by) | (value >> (32 - by))) & 0xFFFFFFFF

    r3 = ((word & 0x001B001B) * 0x4108) & keep
    regs = [word & keep, rotl(word, 13) & keep, rotl(word, 10) & keep, r3]
    return [(r >> (16 * h)) & 0xFFFF for r in regs for h in (0, 1)]


def test_lanes_read_as_the_reference_values() -> None:
    """Every code at every position of a word, through the decode's masks and shifts: each
    lane is the bf16 bit pattern of the reference value times 2^-126 (registers 0..2 one
    rotation each, register 3 the one-multiply gather)."""
    from kernelbay.formats import decode_e2m1

    want = (decode_e2m1(torch.arange(16, dtype=torch.uint8)) * 2.0**-126).to(torch.bfloat16)
    bits = want.view(torch.int16).to(torch.int64) & 0xFFFF
    for code in range(16):
        for position in range(8):
            nibbles = [(code + 5 * i) % 16 if i != position else code for i in range(8)]
            packed = torch.tensor([[n0 | (n1 << 4) for n0, n1 in zip(nibbles[::2], nibbles[1::2],
                                                                       strict=True)]],
                                  dtype=torch.uint8)
            word = int(repack_e2m1_words(packed)[0, 0]) & 0xFFFFFFFF
            assert _lanes(word)[position] == int(bits[code]), (code, position)


def test_large_stacks_repack_in_steps() -> None:
    """Rows beyond one step (4096) repack and unpack like the first ones."""
    packed = torch.randint(0, 256, (4100, 8), generator=torch.Generator().manual_seed(5),
                           dtype=torch.uint8)
    words = repack_e2m1_words(packed)
    assert torch.equal(words[4096:], repack_e2m1_words(packed[4096:]))
    assert torch.equal(unpack_e2m1_words(words), packed)
    assert torch.equal(checkpoint_layout(words), packed) and checkpoint_layout(packed) is packed
