"""The batch-invariant matmul (Triton interpreter on CPU, tiny shapes): a row's output is
bitwise the same whatever the number of rows, and matches torch within rounding."""

from __future__ import annotations

import pytest
import torch
from kernelbay_batch_invariant.configs import matmul_config

# Tensors live on the CPU and the kernels run in the interpreter; test_gpu.py covers CUDA.
pytestmark = [pytest.mark.skipif(torch.cuda.is_available(),
                                 reason="interpreter tests (CPU tensors); test_gpu.py runs on CUDA"),
              pytest.mark.triton_interpreter]

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


#: How a split's slices are summed: a second kernel, the tile's last program, or one
#: program walking every slice of its tile (chosen by the number of tiles on a GPU).
SUMS = {"sum-kernel": (False, False), "sum-in-kernel": (True, False),
        "whole-tile": (False, True)}


def _split_mm(x: torch.Tensor, w: torch.Tensor, split: int, in_kernel: bool = False,
              whole: bool = False) -> torch.Tensor:
    from kernelbay_batch_invariant.configs import MatmulConfig
    from kernelbay_batch_invariant.kernels import invariant_matmul

    return invariant_matmul(x, w, MatmulConfig(16, 16, 16, 4, 1, split_k=split,
                                               sum_in_kernel=in_kernel), whole_tiles=whole)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits (``torch.equal`` calls -0.0 and 0.0 equal; these differ)."""
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


@pytest.mark.parametrize("how", list(SUMS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split", [2, 3, 8])
def test_split_k_rows_are_bitwise_identical_for_m_1_to_9(dtype: torch.dtype, split: int,
                                                         how: str) -> None:
    # K = 70: five 16-wide K tiles, a ragged last one; split 8 leaves empty slices.
    g = torch.Generator().manual_seed(split)
    n, k = 24, 70
    w = torch.randn(n, k, generator=g).to(dtype)
    rows = torch.randn(9, k, generator=g).to(dtype)
    full = _split_mm(rows, w, split, *SUMS[how])
    for m in range(1, 10):
        assert torch.equal(_bits(_split_mm(rows[:m], w, split, *SUMS[how])),
                           _bits(full[:m])), f"rows differ at M={m}"
        tail = _split_mm(rows[9 - m:], w, split, *SUMS[how])  # rows at other tile places
        assert torch.equal(_bits(tail), _bits(full[9 - m:])), f"rows differ (offset) at M={m}"
    ref = (rows.float() @ w.float().T).to(dtype)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(full, ref, atol=tol * 10, rtol=tol)


def test_split_k_adds_the_fixed_slices_in_slice_order() -> None:
    """The split result is exactly (((slice 0) + slice 1) + slice 2): each slice's partial
    is the unsplit kernel on that K range, and the slices are the fixed ``split_ranges``."""
    from kernelbay_batch_invariant.configs import MatmulConfig
    from kernelbay_batch_invariant.kernels import invariant_matmul, split_ranges

    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 70, generator=g)
    w = torch.randn(20, 70, generator=g)
    cfg = MatmulConfig(16, 16, 16, 4, 1, split_k=3)
    ranges = split_ranges(70, cfg)
    assert ranges == [(0, 32), (32, 64), (64, 70)]
    whole = MatmulConfig(16, 16, 16, 4, 1)
    parts = [invariant_matmul(x[:, lo:hi].contiguous(), w[:, lo:hi].contiguous(), whole)
             for lo, hi in ranges]
    expected = _bits((parts[0] + parts[1]) + parts[2])
    for how, (in_kernel, whole) in SUMS.items():  # same order, same bits, whoever sums
        assert torch.equal(_bits(_split_mm(x, w, 3, in_kernel, whole)), expected), how
    # The arrival counters are back to zero: a second call sums the same way.
    assert torch.equal(_bits(_split_mm(x, w, 3, in_kernel=True)), expected)


def test_split_ranges_depend_on_k_and_config_only() -> None:
    from kernelbay_batch_invariant.configs import MatmulConfig
    from kernelbay_batch_invariant.kernels import split_ranges

    cfg = MatmulConfig(64, 128, 64, split_k=4)
    assert split_ranges(14336, cfg) == [(0, 3584), (3584, 7168), (7168, 10752),
                                        (10752, 14336)]
    assert split_ranges(100, MatmulConfig(16, 16, 64, split_k=3)) == [(0, 64), (64, 100),
                                                                      (100, 100)]
    assert split_ranges(4096, MatmulConfig(64, 64, 64)) == [(0, 4096)]


def test_split_k_below_one_is_rejected_with_the_value() -> None:
    from kernelbay_batch_invariant.configs import MatmulConfig
    from kernelbay_batch_invariant.kernels import invariant_matmul

    with pytest.raises(ValueError, match=r"config\.split_k is 0; valid: an integer >= 1"):
        invariant_matmul(torch.zeros(2, 32), torch.zeros(16, 32),
                         MatmulConfig(16, 16, 16, split_k=0))


@pytest.mark.parametrize("split", [2, 4])
def test_whole_tile_k_walk_equals_the_slice_programs_with_signed_zeros(split: int) -> None:
    """The whole-tile K loop (slices added at their last tile) against one program per
    slice and the second-kernel sum: raw bits equal, also for rows of -0.0 / 0.0 against
    negative weights (products -0.0) and K = 7 tiles (slices of 2..4 tiles, a ragged one)."""
    g = torch.Generator().manual_seed(11 + split)
    n, k = 20, 100
    w = torch.randn(n, k, generator=g)
    w[:4] = -w[:4].abs()
    x = torch.randn(6, k, generator=g)
    x[1] = 0.0
    x[2] = -0.0
    x[3, : k // 2] = -0.0
    results = {how: _split_mm(x, w, split, *SUMS[how]) for how in SUMS}
    for how, y in results.items():
        assert torch.equal(_bits(y), _bits(results["sum-kernel"])), how
    torch.testing.assert_close(results["whole-tile"], x @ w.T, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("how", list(SUMS))
def test_split_k_with_k_zero_gives_positive_zeros(how: str) -> None:
    y = _split_mm(torch.zeros(3, 0), torch.zeros(16, 0), 4, *SUMS[how])
    assert torch.equal(_bits(y), _bits(torch.zeros(3, 16))), how


@pytest.mark.parametrize("in_kernel", [False, True])
@pytest.mark.parametrize("split, group", [(4, 2), (4, 4), (6, 3), (8, 2), (8, 4)])
def test_programs_walking_several_slices_give_the_per_slice_bits(split: int, group: int,
                                                                 in_kernel: bool) -> None:
    """``slices_per_program``: each program walks ``group`` consecutive slices and stores
    each partial apart; raw bits equal one program per slice and the whole-tile loop, also
    with slices past the end of K (K = 70: five tiles of 16; split 6 / 8 leave empty ones,
    whole programs of them included), rows of -0.0 against negative weights, ragged M."""
    from kernelbay_batch_invariant.configs import MatmulConfig
    from kernelbay_batch_invariant.kernels import invariant_matmul

    g = torch.Generator().manual_seed(41 + split * 10 + group)
    n, k = 24, 70
    w = torch.randn(n, k, generator=g)
    w[:4] = -w[:4].abs()
    x = torch.randn(7, k, generator=g)
    x[1] = -0.0
    x[2, : k // 2] = -0.0
    cfg = MatmulConfig(16, 16, 16, 4, 1, split_k=split, sum_in_kernel=in_kernel)
    expected = _bits(invariant_matmul(x, w, cfg, whole_tiles=False, slices_per_program=1))
    assert torch.equal(_bits(invariant_matmul(x, w, cfg, whole_tiles=True)), expected)
    for m in (1, 5, 7):
        got = invariant_matmul(x[:m], w, cfg, whole_tiles=False, slices_per_program=group)
        assert torch.equal(_bits(got), expected[:m]), f"M={m}"
    # A second call: the in-kernel arrival counters were reset by the last program.
    again = invariant_matmul(x, w, cfg, whole_tiles=False, slices_per_program=group)
    assert torch.equal(_bits(again), expected)


def test_slices_per_program_must_divide_the_split() -> None:
    from kernelbay_batch_invariant.configs import MatmulConfig
    from kernelbay_batch_invariant.kernels import _slices_per_program, invariant_matmul

    with pytest.raises(ValueError, match=r"slices_per_program is 3; valid: a divisor of "
                                         r"config\.split_k = 4"):
        invariant_matmul(torch.zeros(2, 32), torch.zeros(16, 32),
                         MatmulConfig(16, 16, 16, split_k=4), whole_tiles=False,
                         slices_per_program=3)
    # 132 SMs: 64 x 128 tiles at N = 4096, split 4: M = 256 has 128 tiles (2 slices a
    # program, 256 programs), M = 128 has 64 (one slice a program, 256 programs).
    assert _slices_per_program(128, 4, 132) == 2
    assert _slices_per_program(64, 4, 132) == 1
    assert _slices_per_program(32, 8, 132) == 1
    assert _slices_per_program(64, 8, 132) == 2


@pytest.mark.parametrize("how", list(SUMS))
@pytest.mark.parametrize("split", [1, 3])
def test_tma_loads_give_the_pointer_loads_bits_and_rows_do_not_follow_m(split: int,
                                                                        how: str) -> None:
    """``config.tma`` (tensor-descriptor loads; out-of-range rows and K read as zeros) gives
    the pointer-load kernel's raw bits, also for a ragged K tail and rows at other places in
    the tiles, and a row does not depend on M; a misaligned ``x`` view is copied first."""
    from kernelbay_batch_invariant.configs import MatmulConfig
    from kernelbay_batch_invariant.kernels import invariant_matmul

    g = torch.Generator().manual_seed(21 + split)
    n, k = 24, 72  # 4.5 K tiles of 16: a ragged last tile; 144-byte rows (16-aligned)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    rows = torch.randn(9, k, generator=g).to(torch.bfloat16)
    in_kernel, whole = SUMS[how]

    def mm(x: torch.Tensor, tma: bool) -> torch.Tensor:
        cfg = MatmulConfig(16, 16, 16, 4, 1, split_k=split, sum_in_kernel=in_kernel, tma=tma)
        return invariant_matmul(x, w, cfg, whole_tiles=whole)

    full = mm(rows, True)
    assert torch.equal(_bits(full), _bits(mm(rows, False)))
    for m in (1, 4, 9):
        assert torch.equal(_bits(mm(rows[:m], True)), _bits(full[:m])), f"M={m}"
        assert torch.equal(_bits(mm(rows[9 - m:], True)), _bits(full[9 - m:])), f"M={m}"
    odd = torch.randn(9, k + 1, generator=g).to(torch.bfloat16)
    odd[:, 1:] = rows
    assert torch.equal(_bits(mm(odd[:, 1:], True)), _bits(full))  # 2-byte offset, stride 73


@pytest.mark.parametrize("split", [1, 3])
def test_whole_tile_loads_and_stages_keep_the_bits_at_every_m(split: int) -> None:
    """``whole_tma`` / ``whole_stages`` (descriptor loads and another pipeline depth for the
    whole-tile mode only) give the plain config's raw bits in every way of summing, and rows
    for M = 1..9 equal those of M = 9 whichever mode each M takes."""
    from kernelbay_batch_invariant.configs import MatmulConfig
    from kernelbay_batch_invariant.kernels import invariant_matmul

    g = torch.Generator().manual_seed(31 + split)
    n, k = 24, 72
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    rows = torch.randn(9, k, generator=g).to(torch.bfloat16)
    plain = MatmulConfig(16, 16, 16, 4, 1, split_k=split, sum_in_kernel=True)
    tuned = MatmulConfig(16, 16, 16, 4, 1, split_k=split, sum_in_kernel=True, whole_tma=True,
                         whole_stages=2)
    full = invariant_matmul(rows, w, plain, whole_tiles=True)
    for whole in (True, False, None):
        got = invariant_matmul(rows, w, tuned, whole_tiles=whole)
        assert torch.equal(_bits(got), _bits(full)), whole
    for m in range(1, 10):
        assert torch.equal(_bits(invariant_matmul(rows[:m], w, tuned)), _bits(full[:m])), m


def test_whole_tma_refuses_an_undescribable_k_at_every_m() -> None:
    """The refusal does not wait for an M large enough to run whole tiles."""
    from kernelbay_batch_invariant.configs import MatmulConfig
    from kernelbay_batch_invariant.kernels import invariant_matmul

    cfg = MatmulConfig(16, 16, 16, split_k=2, whole_tma=True)
    for whole in (False, True):
        with pytest.raises(ValueError, match=r"config\.whole_tma needs K \* itemsize .* K is 70"):
            invariant_matmul(torch.zeros(2, 70, dtype=torch.bfloat16),
                             torch.zeros(16, 70, dtype=torch.bfloat16), cfg, whole_tiles=whole)


def test_tma_refuses_a_row_stride_it_cannot_describe() -> None:
    from kernelbay_batch_invariant.configs import MatmulConfig
    from kernelbay_batch_invariant.kernels import invariant_matmul

    with pytest.raises(ValueError, match=r"config\.tma needs K \* itemsize .* K is 70"):
        invariant_matmul(torch.zeros(2, 70, dtype=torch.bfloat16),
                         torch.zeros(16, 70, dtype=torch.bfloat16),
                         MatmulConfig(16, 16, 16, tma=True))


def test_tma_with_k_zero_gives_zeros() -> None:
    from kernelbay_batch_invariant.configs import MatmulConfig
    from kernelbay_batch_invariant.kernels import invariant_matmul

    y = invariant_matmul(torch.zeros(3, 0, dtype=torch.bfloat16),
                         torch.zeros(16, 0, dtype=torch.bfloat16),
                         MatmulConfig(16, 16, 16, tma=True, split_k=2))
    assert torch.equal(_bits(y), _bits(torch.zeros(3, 16, dtype=torch.bfloat16)))
