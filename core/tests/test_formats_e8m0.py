"""E8M0 scale bytes against ml_dtypes.float8_e8m0fnu, bit for bit."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from kernelbay.formats import E8M0_NAN, decode_e8m0, encode_e8m0

E8 = ml_dtypes.float8_e8m0fnu


def test_decode_all_bytes() -> None:
    b = torch.arange(256, dtype=torch.uint8)
    got = decode_e8m0(b)
    want = torch.from_numpy(b.numpy().view(E8).astype(np.float32))
    assert got[255].isnan() and want[255].isnan()
    assert torch.equal(got[:255].view(torch.int32), want[:255].view(torch.int32))
    assert got[0].item() == 2.0**-127 and got[127].item() == 1.0 and got[254].item() == 2.0**127


def test_encode_exponents() -> None:
    e = torch.arange(-127, 128)
    got = encode_e8m0(e)
    powers = np.ldexp(np.float32(1), e.numpy()).astype(np.float32)
    assert torch.equal(got, torch.from_numpy(powers.astype(E8).view(np.uint8).copy()))
    assert torch.equal(decode_e8m0(got), torch.from_numpy(powers))


def test_encode_clamps_where_ml_dtypes_gives_nan() -> None:
    assert encode_e8m0(torch.tensor([-1000, -128, 128, 1000])).tolist() == [0, 0, 254, 254]
    # ml_dtypes: a float too large for E8M0 becomes NaN, and so does 0.0
    with np.errstate(over="ignore"):
        big_zero = np.array([2.0**128, 0.0]).astype(E8).view(np.uint8).tolist()
    assert big_zero == [E8M0_NAN, E8M0_NAN]
    with pytest.raises(TypeError):
        encode_e8m0(torch.tensor([1.0]))
