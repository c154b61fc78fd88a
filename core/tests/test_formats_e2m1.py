"""E2M1 (FP4) codes against ml_dtypes.float4_e2m1fn, bit for bit; packing order."""

from __future__ import annotations

import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import torch
from kernelbay.formats import E2M1_MAX, decode_e2m1, encode_e2m1, pack_e2m1, unpack_e2m1

F4 = ml_dtypes.float4_e2m1fn
MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def ml_codes(x: torch.Tensor) -> torch.Tensor:
    """ml_dtypes' E2M1 code (RNE, saturating) of each float32 value."""
    return torch.from_numpy(x.float().numpy().astype(F4).view(np.uint8).copy())


def test_import_kernelbay_does_not_import_formats() -> None:
    code = "import sys, kernelbay; assert 'kernelbay.formats' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_decode_all_codes_bit_exact() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    want = torch.from_numpy(codes.numpy().view(F4).astype(np.float32))
    got = decode_e2m1(codes)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # -0.0 included
    assert got[:8].tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert torch.equal(encode_e2m1(got), codes)


def test_encode_random_bit_exact() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(20000, generator=g) * torch.exp2(torch.randint(-6, 6, (20000,), generator=g))
    assert torch.equal(encode_e2m1(x), ml_codes(x))


def test_encode_midpoints_ties_to_even() -> None:
    mids = torch.tensor(MIDPOINTS)
    up, down = torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)
    x = torch.cat([mids, up, down, torch.tensor(list(torch.arange(8) / 2))])
    x = torch.cat([x, -x])
    assert torch.equal(encode_e2m1(x), ml_codes(x))
    # ties: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4
    assert decode_e2m1(encode_e2m1(mids)).tolist() == [0, 1, 1, 2, 2, 4, 4]


def test_encode_saturates_and_signs() -> None:
    x = torch.tensor([6.0, 6.5, 7.0, 1e30, float("inf"), -7.0, -float("inf"), -0.0, -0.1, 1e-30])
    got = encode_e2m1(x)
    assert got.tolist() == [7, 7, 7, 7, 7, 15, 15, 8, 8, 0]
    assert torch.equal(got, ml_codes(x))  # ml_dtypes saturates the same way
    assert decode_e2m1(got).abs().max().item() == E2M1_MAX


def test_nan_policy_differs_from_ml_dtypes() -> None:
    nan = torch.tensor([float("nan"), -float("nan")])
    assert encode_e2m1(nan).tolist() == [7, 7]  # documented: NaN -> +6
    assert ml_codes(nan[:1]).tolist() == [8]  # ml_dtypes writes -0 instead


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_encode_other_dtypes(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(4000, generator=g) * 3).to(dtype)
    assert torch.equal(encode_e2m1(x), ml_codes(x.double().float()))


def test_pack_nibble_order_and_round_trip() -> None:
    codes = torch.tensor([[1, 7, 10, 5]], dtype=torch.uint8)  # 0.5, 6, -1, 3
    assert pack_e2m1(codes).tolist() == [[0x71, 0x5A]]  # element 2i in the low nibble
    g = torch.Generator().manual_seed(3)
    c = torch.randint(0, 16, (3, 5, 64), generator=g, dtype=torch.uint8)
    p = pack_e2m1(c)
    assert p.shape == (3, 5, 32)
    assert torch.equal(unpack_e2m1(p), c)


def test_pack_errors() -> None:
    with pytest.raises(ValueError, match="K=3"):
        pack_e2m1(torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"0\.\.15"):
        decode_e2m1(torch.tensor([16], dtype=torch.uint8))
    with pytest.raises(TypeError):
        encode_e2m1(torch.tensor([1, 2]))
