"""E4M3 (float8_e4m3fn) against ml_dtypes, bit for bit, and the clamp-before-cast policy."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch
from kernelbay.formats import E4M3_MAX, e4m3_bits, from_e4m3_bits, to_e4m3

F8 = ml_dtypes.float8_e4m3fn


def ml_bits(x: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(x.float().numpy().astype(F8).view(np.uint8).copy())


def test_decode_all_bytes() -> None:
    b = torch.arange(256, dtype=torch.uint8)
    got = from_e4m3_bits(b).float()
    want = torch.from_numpy(b.numpy().view(F8).astype(np.float32))
    assert torch.equal(got.isnan(), want.isnan())
    assert got.isnan().nonzero().flatten().tolist() == [0x7F, 0xFF]
    ok = ~got.isnan()
    assert torch.equal(got[ok].view(torch.int32), want[ok].view(torch.int32))
    assert torch.equal(e4m3_bits(from_e4m3_bits(b)), b)
    assert got[0x7E].item() == E4M3_MAX and got[0x01].item() == 2.0**-9


def test_encode_random_and_midpoints_bit_exact() -> None:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(20000, generator=g) * torch.exp2(torch.randint(-14, 9, (20000,), generator=g))
    x = x.clamp(-460, 460)  # in range for ml_dtypes (it turns > 464 into NaN)
    values = from_e4m3_bits(torch.arange(0, 0x7E, dtype=torch.uint8)).float()
    mids = (values[1:] + values[:-1]) / 2  # exact in fp32
    edge = torch.cat([mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)])
    x = torch.cat([x, edge, -edge, torch.tensor([2.0**-10, 2.0**-10 * 1.001, -0.0])])
    assert torch.equal(e4m3_bits(to_e4m3(x)), ml_bits(x))


def test_saturation_differs_from_ml_dtypes() -> None:
    x = torch.tensor([463.99, 464.0, 464.1, 500.0, 1e30, float("inf"), -1e30, -float("inf")])
    assert e4m3_bits(to_e4m3(x)).tolist() == [0x7E] * 6 + [0xFE] * 2  # clamp: ±448
    want = ml_bits(x).tolist()  # ml_dtypes: up to 464 (a tie, to even) -> 448, above -> NaN
    assert want[:2] == [0x7E, 0x7E] and all(b & 0x7F == 0x7F for b in want[2:])
    assert to_e4m3(torch.tensor([float("nan")])).float().isnan().all()
