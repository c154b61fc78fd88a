"""The compiled kernels against the one FP8 reference (``kernelbay.formats.fp8``).

Error bound (derived, not tuned). Inputs are exact in both computations: x is bf16, an E4M3
weight is exact in bf16, each product x*w (8 x 4 significant bits) is exact in fp32, and the
reference multiplies by the fp32 scale and sums in float64. The kernel sums one K block's
products in fp32 (at most bk additions per lane, <= K), multiplies that partial by its scale
and adds it to the running total (one fused rounding per block), then adds the bias. Recursive
summation of n terms errs by at most (n - 1) u sum|terms| (u = 2^-24), so

    |y_fp32 - y| <= (K + num_k_blocks + 4) * 2^-24 * (|x| @ |W s|^T + |bias|) =: e32

and a bf16 output rounds once more to nearest: |y_bf16 - y| <= e32 + 2^-8 (|y| + e32).
A wrong scale, a wrong element or a misplaced column errs by O(|y|), far above this.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from cpu_amx_helpers import (
    KERNEL_FLAGS,
    assert_within_bound,
    make_scale,
    packed_layer,
    random_codes,
    reference,
)

pytestmark = pytest.mark.cpu_isa(*KERNEL_FLAGS)

MS = (1, 3, 15, 16, 17, 64, 100)
#: (N, K, group) -- group None is per-tensor; N = 96 takes the 32-column kernels, 128 the
#: 64-column ones; groups cover per-row, 128 x 128, narrow K blocks and a ragged N grid.
LAYOUTS = (
    (128, 256, None),
    (96, 256, None),
    (128, 256, (128, 128)),
    (96, 256, (128, 128)),   # ceil(96 / 128) = 1 scale row
    (128, 384, (1, 128)),    # one scale per output row
    (96, 256, (32, 64)),
    (64, 128, (16, 32)),
)


def conversions(ext: ModuleType) -> list[str]:
    """The E4M3 conversions this CPU runs: the integer one always, VBMI where present."""
    return ["int", "vbmi"] if ext.vbmi_supported() else ["int"]


def check_case(n: int, k: int, group: tuple[int, int] | None, m: int, path: str, conv: str,
               use_amx: bool, with_bias: bool, out_dtype: torch.dtype, seed: int) -> None:
    from kernelbay_cpu_amx import kernels

    gen = torch.Generator().manual_seed(seed)
    q = random_codes(n, k, gen)
    scale = make_scale(n, k, group, gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    x = torch.randn(m, k, generator=gen) * 4
    if m > 2:
        x[1] = 0.0  # a zero row: the output row is exactly the bias
    x = x.to(out_dtype)
    layer = packed_layer(q, scale, group, bias)
    out = kernels.linear(layer, x, path=path, use_amx=use_amx, conv=conv)  # type: ignore[arg-type]
    assert out.shape == (m, n) and out.dtype == out_dtype
    y, mag = reference(x, q, scale, group, bias)
    assert_within_bound(out, y, mag, k, 1 if group is None else k // group[1])
    if m > 2:
        expected_row = torch.zeros(n) if bias is None else bias
        assert torch.equal(out[1].float(), expected_row.to(out_dtype).float())


@pytest.mark.parametrize("n, k, group", LAYOUTS)
@pytest.mark.parametrize("path", ["decode", "tiled"])
def test_random_codes_within_bound(ext: ModuleType, n: int, k: int,
                                   group: tuple[int, int] | None, path: str) -> None:
    for conv in conversions(ext):
        for i, m in enumerate(MS):
            check_case(n, k, group, m, path, conv, False, with_bias=i % 2 == 0,
                       out_dtype=torch.bfloat16, seed=1000 * m + n + k)


@pytest.mark.parametrize("group", [None, (128, 128), (1, 32)])
@pytest.mark.parametrize("path", ["decode", "tiled"])
def test_float32_activations_give_float32_within_bound(ext: ModuleType,
                                                       group: tuple[int, int] | None,
                                                       path: str) -> None:
    for conv in conversions(ext):
        for m in (1, 17, 64):
            check_case(128, 256, group, m, path, conv, False, with_bias=True,
                       out_dtype=torch.float32, seed=7 * m)


@pytest.mark.parametrize("path", ["decode", "tiled"])
@pytest.mark.parametrize("n", [96, 128])
def test_every_code_decodes_exactly(ext: ModuleType, path: str, n: int) -> None:
    """Each of the 256 codes through the kernel (one-hot x, unit scale, fp32 out) equals
    torch's float8_e4m3fn -> float32 cast, NaN codes included."""
    from kernelbay_cpu_amx import kernels

    codes = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    k = 32
    for conv in conversions(ext):
        for start in range(0, 256, n):
            chunk = codes[start:start + n]
            q = torch.zeros(n, k, dtype=torch.uint8)
            q[: len(chunk), 5] = chunk
            layer = packed_layer(q.view(torch.float8_e4m3fn), torch.ones(()), None, None)
            x = torch.zeros(1, k)
            x[0, 5] = 1.0
            out = kernels.linear(layer, x, path=path, use_amx=False, conv=conv)  # type: ignore[arg-type]
            want = q[:, 5].view(torch.float8_e4m3fn).float()
            assert torch.equal(out[0].isnan(), want.isnan()), conv
            finite = ~want.isnan()
            assert torch.equal(out[0][finite], want[finite]), conv


@pytest.mark.parametrize("path", ["decode", "tiled"])
def test_max_magnitude_weights(ext: ModuleType, path: str) -> None:
    from kernelbay_cpu_amx import kernels

    n, k, group = 128, 256, (128, 128)
    gen = torch.Generator().manual_seed(3)
    sign = torch.where(torch.rand(n, k, generator=gen) < 0.5, -1.0, 1.0)
    q = (448.0 * sign).to(torch.float8_e4m3fn)
    scale = make_scale(n, k, group, gen)
    for conv in conversions(ext):
        for m in (1, 16, 100):
            x = (torch.randn(m, k, generator=gen) * 100).to(torch.bfloat16)
            out = kernels.linear(packed_layer(q, scale, group, None), x, path=path,
                                 use_amx=False, conv=conv)  # type: ignore[arg-type]
            y, mag = reference(x, q, scale, group, None)
            assert_within_bound(out, y, mag, k, k // group[1])


@pytest.mark.parametrize("path", ["decode", "tiled"])
def test_zero_weights_and_zero_scale_give_bias(ext: ModuleType, path: str) -> None:
    from kernelbay_cpu_amx import kernels

    n, k = 64, 128
    bias = torch.randn(n)
    x = torch.randn(5, k).to(torch.bfloat16)
    zeros = torch.zeros(n, k).to(torch.float8_e4m3fn)
    for conv in conversions(ext):
        out = kernels.linear(packed_layer(zeros, torch.ones(1, 1), (128, 128), bias), x,
                             path=path, use_amx=False, conv=conv)  # type: ignore[arg-type]
        assert torch.equal(out, bias.to(torch.bfloat16).expand(5, n))
        codes = random_codes(n, k, torch.Generator().manual_seed(0))
        out = kernels.linear(packed_layer(codes, torch.zeros(()), None, bias), x, path=path,
                             use_amx=False, conv=conv)  # type: ignore[arg-type]
        assert torch.equal(out, bias.to(torch.bfloat16).expand(5, n))


def test_nan_code_poisons_only_its_column(ext: ModuleType) -> None:
    from kernelbay_cpu_amx import kernels

    n, k = 64, 128
    q = random_codes(n, k, torch.Generator().manual_seed(1)).view(torch.uint8).clone()
    q[7, 100] = 0xFF  # -NaN
    layer = packed_layer(q.view(torch.float8_e4m3fn), torch.ones(1, 1), (128, 128), None)
    x = torch.randn(3, k).to(torch.bfloat16)
    for conv in conversions(ext):
        for path in ("decode", "tiled"):
            out = kernels.linear(layer, x, path=path, use_amx=False, conv=conv)  # type: ignore[arg-type]
            assert out[:, 7].isnan().all()
            assert not out[:, [c for c in range(n) if c != 7]].isnan().any()


def test_leading_dims_and_empty_batch(ext: ModuleType) -> None:
    from kernelbay_cpu_amx import kernels

    gen = torch.Generator().manual_seed(4)
    q = random_codes(64, 128, gen)
    scale = make_scale(64, 128, (128, 128), gen)
    layer = packed_layer(q, scale, (128, 128), None)
    x = torch.randn(2, 3, 128, generator=gen).to(torch.bfloat16)
    out = kernels.linear(layer, x)  # type: ignore[arg-type]
    assert out.shape == (2, 3, 64)
    assert torch.equal(out.reshape(6, 64), kernels.linear(layer, x.reshape(6, 128)))  # type: ignore[arg-type]
    assert kernels.linear(layer, x[:0]).shape == (0, 3, 64)  # type: ignore[arg-type]


def test_bf16_weights_match_fp32_reference(ext: ModuleType) -> None:
    from kernelbay_cpu_amx import kernels

    gen = torch.Generator().manual_seed(5)
    n, k = 96, 256
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen)
    layer = kernels.PackedLinear(kernels.pack_weight(w), torch.ones(()), None, bias, n, k)
    for m in MS:
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        y = x.double() @ w.double().t() + bias.double()
        mag = x.double().abs() @ w.double().abs().t() + bias.double().abs()
        for path in ("decode", "tiled"):
            out = kernels.linear(layer, x, path=path, use_amx=False)
            assert_within_bound(out, y, mag, k, 1)


def test_shape_checks_name_the_values(ext: ModuleType) -> None:
    from kernelbay_cpu_amx import kernels

    q = random_codes(64, 128, torch.Generator().manual_seed(6))
    layer = packed_layer(q, torch.ones(1, 1), (128, 128), None)
    with pytest.raises(ValueError, match="x has K=64, the layer has K=128"):
        kernels.linear(layer, torch.zeros(1, 64, dtype=torch.bfloat16))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="float16"):
        kernels.linear(layer, torch.zeros(1, 128, dtype=torch.float16))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="N=100 is not a multiple of 32"):
        kernels.pack_weight(torch.zeros(100, 128).to(torch.float8_e4m3fn))
    with pytest.raises(RuntimeError, match="not a multiple of 32"):
        ext.linear(torch.zeros(1, 96, dtype=torch.bfloat16), kernels.pack_weight(
            torch.zeros(32, 96).to(torch.float8_e4m3fn)), torch.ones(2, 1), 32, None, False,
            "decode", False)


@pytest.mark.cpu_isa("amx_bf16", "amx_tile")
@pytest.mark.parametrize("n, k, group", LAYOUTS)
def test_amx_tiles_within_bound(ext: ModuleType, n: int, k: int,
                                group: tuple[int, int] | None) -> None:
    from kernelbay_cpu_amx import kernels

    if not kernels.amx_usable():
        pytest.skip("the CPU reports AMX but the OS did not grant tile data "
                    "(arch_prctl ARCH_REQ_XCOMP_PERM failed)")
    for conv in conversions(ext):
        for i, m in enumerate((1, 5, 16, 17, 32, 33, 64, 100, 300)):
            check_case(n, k, group, m, "tiled", conv, True, with_bias=i % 2 == 1,
                       out_dtype=torch.bfloat16 if i % 2 else torch.float32, seed=m + n)


def test_path_choice_follows_the_tuning_table() -> None:
    from kernelbay_cpu_amx.kernels import AMX_MIN_M, DECODE_MAX_M, choose_path

    for kind, limit in DECODE_MAX_M.items():
        assert choose_path(1, kind) == "decode"
        assert choose_path(limit, kind) == "decode"
        assert choose_path(limit + 1, kind) == "tiled"
        assert choose_path(AMX_MIN_M[kind] - 1, kind, amx=True) == "decode"
        assert choose_path(AMX_MIN_M[kind], kind, amx=True) == "tiled"
