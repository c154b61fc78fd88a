"""The repacked E2M1 word layout: a bit permutation of each word (round trip, every bit used
once) and the positions the GPU decodes' masks assume."""

from __future__ import annotations

import pytest
import torch
from kernelbay.formats import repack_e2m1_words, unpack_e2m1_words, word_bit_positions


def test_positions_use_every_bit_once() -> None:
    flat = [bit for element in word_bit_positions() for bit in element]
    assert sorted(flat) == list(range(32))


def test_registers_read_as_bf16_after_their_shift() -> None:
    """Registers 0..2 of a word are the word shifted left by 0, 3, 6 under the mask
    0x81C081C0: each element's sign lands on bit 15 (+16) and e1 e0 m on bits 8..6."""
    positions = word_bit_positions()
    for e in range(6):
        reg, half = divmod(e, 2)
        sign, e1, e0, m = (p + 3 * reg for p in positions[e])
        assert (sign, e1, e0, m) == (15 + 16 * half, 8 + 16 * half, 7 + 16 * half, 6 + 16 * half)


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
