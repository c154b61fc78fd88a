"""``formats.divide``: IEEE division on every device (the references' scales depend on it)."""

from __future__ import annotations

import pytest
import torch
from kernelbay.formats.division import divide


def _check(device: str) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.rand(1 << 16, generator=gen) * 1000,
                   torch.exp2(torch.randint(-140, 120, (4096,), generator=gen).float())])
    for d in (448.0, 6.0 * 448.0, 3.0):
        got = divide(x.to(device), d).cpu()
        # float64 quotients of float32 operands round to the correctly rounded float32 ones.
        assert torch.equal(got, (x.double() / d).float()), d


def test_divide_rounds_correctly_on_cpu() -> None:
    _check("cpu")


@pytest.mark.gpu
def test_divide_rounds_correctly_on_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device; none here")
    _check("cuda")
