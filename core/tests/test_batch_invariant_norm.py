"""The engine's RMSNorm in batch-invariant mode: a fixed-order sum, bitwise the same for a
row whatever the batch holds, equal to the plain mean within rounding."""

from __future__ import annotations

import pytest
import torch
from kernelbay.engine.modules import RMSNorm, invariant_mean_square


@pytest.mark.parametrize("width", [1, 7, 64, 100, 4096])
def test_mean_square_matches_torch(width: int) -> None:
    x = torch.randn(5, width, generator=torch.Generator().manual_seed(width))
    torch.testing.assert_close(invariant_mean_square(x), x.pow(2).mean(-1, keepdim=True),
                               rtol=1e-5, atol=1e-6)
    assert torch.equal(invariant_mean_square(torch.zeros(2, width)), torch.zeros(2, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_rows_do_not_depend_on_the_batch(dtype: torch.dtype) -> None:
    norm = RMSNorm(96, 1e-5, dtype, torch.device("cpu"))
    norm.batch_invariant = True
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96))
    g = torch.Generator().manual_seed(4)
    row = (torch.randn(1, 96, generator=g) * 3).to(dtype)
    alone = norm(row)
    for m in (2, 5, 33, 256):
        batch = torch.cat([torch.randn(m - 1, 96, generator=g).to(dtype), row])
        assert torch.equal(norm(batch)[-1], alone[0])
    plain = RMSNorm(96, 1e-5, dtype, torch.device("cpu"))
    with torch.no_grad():
        plain.weight.copy_(norm.weight)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(norm(row), plain(row), atol=tol, rtol=tol)
