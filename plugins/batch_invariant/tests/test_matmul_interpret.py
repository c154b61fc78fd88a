"""The batch-invariant matmul (Triton interpreter on CPU, tiny shapes): a row's output is
bitwise the same whatever the number of rows, and matches torch within rounding."""

from __future__ import annotations

import pytest
import torch
from kernelbay_batch_invariant.configs import matmul_config

# Tensors live on the CPU and the kernels run in the interpreter; test_gpu.py covers CUDA.
pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="interpreter tests (CPU tensors); test_gpu.py runs on CUDA")

HOPPER = 232448


def _mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    from kernelbay_batch_invariant.kernels import invariant_matmul

    dtype = str(x.dtype).removeprefix("torch.")
    return invariant_matmul(x, w, matmul_config(w.shape[0], w.shape[1], dtype, HOPPER))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k", [(24, 40), (16, 64), (1, 33)])
def test_rows_are_bitwise_identical_for_m_1_to_9(dtype: torch.dtype, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n * 100 + k)
    w = torch.randn(n, k, generator=g).to(dtype)
    row = torch.randn(1, k, generator=g).to(dtype)
    others = torch.randn(9, k, generator=g).to(dtype)
    alone = _mm(row, w)
    for m in range(1, 10):
        x = torch.cat([others[: m - 1], row]) if m > 1 else row
        y = _mm(x, w)
        assert torch.equal(y[-1], alone[0]), f"row differs at M={m}"
        # also the same row content repeated: every row equal to the single-row result
        rep = _mm(row.expand(m, k).contiguous(), w)
        assert torch.equal(rep, alone.expand(m, n))


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2),
                                         (torch.float16, 3e-3)])
def test_matches_torch(dtype: torch.dtype, atol: float) -> None:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, 70, generator=g).to(dtype)
    w = torch.randn(33, 70, generator=g).to(dtype)
    ref = (x.float() @ w.float().T).to(dtype)
    torch.testing.assert_close(_mm(x, w), ref, atol=atol, rtol=2e-2)


def test_zeros_extremes_and_empty() -> None:
    w = torch.zeros(16, 32)
    assert torch.equal(_mm(torch.randn(3, 32), w), torch.zeros(3, 16))
    big = torch.full((2, 32), 1e38)
    assert torch.isinf(_mm(big, torch.ones(16, 32))).all()  # overflow to inf, no wrap
    assert _mm(torch.empty(0, 32), torch.ones(16, 32)).shape == (0, 16)


def test_shape_and_dtype_errors_name_the_values() -> None:
    from kernelbay_batch_invariant.kernels import invariant_matmul

    config = matmul_config(16, 32, "float32", HOPPER)
    with pytest.raises(ValueError, match=r"got \(3, 31\) and \(16, 32\)"):
        invariant_matmul(torch.zeros(3, 31), torch.zeros(16, 32), config)
    with pytest.raises(ValueError, match=r"x is torch\.bfloat16, weight is torch\.float32"):
        invariant_matmul(torch.zeros(3, 32, dtype=torch.bfloat16), torch.zeros(16, 32), config)


def test_linear_method_adds_bias_per_row() -> None:
    from kernelbay import LinearRequest
    from kernelbay_batch_invariant.linear import BatchInvariantLinear

    method = BatchInvariantLinear(LinearRequest(32, 16, activation_dtype="float32", bias=True))
    method._config = matmul_config(16, 32, "float32", HOPPER)
    layer = torch.nn.Module()
    method.create_weights(layer)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    x = torch.randn(2, 3, 32, generator=g)
    y = method.apply(layer, x)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, layer.weight, layer.bias),
                               atol=1e-4, rtol=1e-4)
