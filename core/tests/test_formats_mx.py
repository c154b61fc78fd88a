"""OCP MX (MXFP4 / MXFP8): the scale rules against exact rational math and against torchao.

Known differences from torchao 0.18 (seen on torch 2.13 CPU), none in the compared tests:
for blocks whose scale byte is 0 (amax below about 2^-124) the scale bytes agree, but
torchao's floor/even path divides the elements by 2^-126 instead of the stored 2^-127 and its
rceil path by 1.0 (so they flush to zero). For an Inf amax its floor/even rules give byte
255 - 1 - emax (253 for E2M1, 247 for E4M3) where the reference, like torchao's rceil, gives
254.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch
from kernelbay.formats import (
    decode_e8m0,
    dequantize_mx,
    e4m3_bits,
    encode_e2m1,
    mx_block_exponent,
    pack_e2m1,
    quantize_mx,
    to_e4m3,
)

ELEMS: dict[str, tuple[int, float, int]] = {"e2m1": (2, 6.0, 1), "e4m3": (8, 448.0, 3)}
RULES = ("floor", "even", "rceil")


def _floor_log2(q: Fraction) -> int:
    e = q.numerator.bit_length() - q.denominator.bit_length()
    while Fraction(2) ** e > q:
        e -= 1
    while Fraction(2) ** (e + 1) <= q:
        e += 1
    return e


def exact_exponent(amax: float, elem: str, rule: str) -> int:
    """The block exponent from the rule's definition, in exact rational arithmetic."""
    emax, vmax, mbits = ELEMS[elem]
    a = Fraction(max(amax, 2.0**-126))
    if rule == "floor":
        x = _floor_log2(a) - emax
    elif rule == "even":
        e = _floor_log2(a)
        sig = a / Fraction(2) ** e  # in [1, 2)
        rounded = Fraction(math.floor(sig * 2**mbits + Fraction(1, 2)), 2**mbits)
        x = _floor_log2(rounded * Fraction(2) ** e) - emax
    else:
        q = a / Fraction(vmax)
        e = _floor_log2(q)
        x = e if Fraction(2) ** e == q else e + 1
    return max(-127, min(127, x))


def random_blocks(rows: int, blocks: int, seed: int, lo: int = -40, hi: int = 40) -> torch.Tensor:
    """Gaussian blocks of 32 with per-block magnitudes 2^U(lo, hi)."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.randint(lo, hi, (rows, blocks, 1), generator=g).float())
    return (torch.randn(rows, blocks, 32, generator=g) * mag).reshape(rows, blocks * 32)


def edge_amaxes() -> torch.Tensor:
    """Powers of two, element maxima times powers of two, the 'even' carry points, neighbours."""
    base = []
    for e in range(-130, 128, 7):
        for m in (1.0, 1.5, 1.75, 1.875, 1.9375, 1.96875, 6 / 4, 448 / 256):
            base.append(m * 2.0**e)
    t = torch.tensor(base, dtype=torch.float32)
    t = t[torch.isfinite(t)]
    return torch.cat([t, torch.nextafter(t, t * 2), torch.nextafter(t, t / 2), torch.zeros(1)])


@pytest.mark.parametrize("elem", ["e2m1", "e4m3"])
@pytest.mark.parametrize("rule", RULES)
def test_exponent_matches_exact_math(elem: Any, rule: Any) -> None:
    g = torch.Generator().manual_seed(5)
    rand = torch.exp2(torch.empty(3000).uniform_(-140, 127, generator=g))
    amax = torch.cat([edge_amaxes(), rand])
    got = mx_block_exponent(amax, elem, rule).tolist()
    want = [exact_exponent(a, elem, rule) for a in amax.tolist()]
    assert got == want


def test_exponent_table() -> None:
    # amax 6, 6.8 (=1.7*4), 7 (=1.75*4) with E2M1: the three rules disagree
    amax = torch.tensor([6.0, 6.8, 7.0])
    assert mx_block_exponent(amax, "e2m1", "floor").tolist() == [0, 0, 0]
    assert mx_block_exponent(amax, "e2m1", "even").tolist() == [0, 0, 1]
    assert mx_block_exponent(amax, "e2m1", "rceil").tolist() == [0, 1, 1]
    with pytest.raises(ValueError, match="'round'"):
        mx_block_exponent(amax, "e2m1", "round")
    with pytest.raises(ValueError, match="'e5m2'"):
        mx_block_exponent(amax, "e5m2", "rceil")


def independent_quantize(x: torch.Tensor, elem: str, rule: str) -> tuple[torch.Tensor, ...]:
    """MX quantization with numpy + ml_dtypes and exact exponents (no kernelbay code path)."""
    xn = x.numpy().astype(np.float32).reshape(x.shape[0], -1, 32)
    amax = np.abs(xn).max(-1)
    exps = np.array([[exact_exponent(float(a), elem, rule) for a in row] for row in amax])
    scaled = np.ldexp(xn, -exps[..., None]).astype(np.float32).reshape(x.shape)
    if elem == "e2m1":  # ml_dtypes saturates E2M1
        codes = torch.from_numpy(scaled.astype(ml_dtypes.float4_e2m1fn).view(np.uint8).copy())
        data = pack_e2m1(codes)
    else:  # ml_dtypes E4M3 overflows to NaN: clamp first
        clamped = np.clip(scaled, -448, 448).astype(ml_dtypes.float8_e4m3fn)
        data = torch.from_numpy(clamped.view(np.uint8).copy())
    return data, torch.from_numpy((exps + 127).astype(np.uint8))


def _bytes(data: torch.Tensor) -> torch.Tensor:
    return e4m3_bits(data) if data.dtype == torch.float8_e4m3fn else data


@pytest.mark.parametrize("elem", ["e2m1", "e4m3"])
@pytest.mark.parametrize("rule", RULES)
def test_quantize_matches_independent_math(elem: Any, rule: Any) -> None:
    x = random_blocks(32, 8, seed=6)
    x[0, :32] = 0.0  # a zero block
    x[1, :32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4)  # E2M1 ties
    data, scales = quantize_mx(x, elem, rule)
    want_data, want_scales = independent_quantize(x, elem, rule)
    assert torch.equal(scales, want_scales)
    assert torch.equal(_bytes(data), want_data)


@pytest.mark.parametrize("elem", ["e2m1", "e4m3"])
@pytest.mark.parametrize("rule", RULES)
def test_quantize_matches_torchao(elem: Any, rule: Any) -> None:
    pytest.importorskip("torchao")
    from torchao.prototype.mx_formats.mx_tensor import ScaleCalculationMode, to_mx

    mode = {"floor": "FLOOR", "even": "EVEN", "rceil": "RCEIL"}[rule]
    elem_dtype = {"e2m1": torch.float4_e2m1fn_x2, "e4m3": torch.float8_e4m3fn}[elem]
    x = random_blocks(64, 8, seed=7, lo=-100, hi=100)  # no scale-byte-0 blocks (see top)
    x[0, :32] = 0.0
    x[1, :32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4)
    x[2, :32] = torch.linspace(-7.0, 7.0, 32)  # amax 7: the rules disagree
    x[3, :32] = torch.linspace(-500.0, 500.0, 32)
    ao_scales, ao_data = to_mx(x, elem_dtype, 32, getattr(ScaleCalculationMode, mode))
    data, scales = quantize_mx(x, elem, rule)
    assert torch.equal(scales, ao_scales.view(torch.uint8))
    assert torch.equal(_bytes(data), _bytes(ao_data.view(data.dtype)))


def test_tiny_blocks_scale_byte_zero() -> None:
    x = torch.full((1, 32), 2.0**-140)
    x[0, 0] = 3 * 2.0**-130
    for rule in RULES:
        data, scales = quantize_mx(x, "e4m3", rule)
        assert scales.tolist() == [[0]]
        deq = dequantize_mx(data, scales, "e4m3")
        assert deq[0, 0].item() == 3 * 2.0**-130  # 3 * 2^-3 * 2^-127, exact in E4M3


def test_floor_rule_clips_where_rceil_does_not() -> None:
    """Failure mode 1: the floor rule clips the block maximum."""
    g = torch.Generator().manual_seed(19)
    for elem, amax in (("e2m1", 7.0), ("e4m3", 500.0)):
        x = torch.zeros(1, 32)
        x[0, 5] = amax
        for rule, clipped in (("floor", True), ("rceil", False)):
            x_exp = mx_block_exponent(torch.tensor(amax), elem, rule).item()
            assert (amax / 2.0**x_exp > ELEMS[elem][1]) is clipped
        fl = dequantize_mx(*quantize_mx(x, elem, "floor"), elem)
        assert fl[0, 5].item() == ELEMS[elem][1]  # 6 or 448 * 2^0: clipped
    # rceil never clips, and is tight (one exponent less would clip) away from the clamp
    amaxes = torch.cat(
        [edge_amaxes(), torch.exp2(torch.empty(5000).uniform_(-120, 120, generator=g))]
    )
    amaxes = amaxes[amaxes > 2.0**-110]
    for elem in ("e2m1", "e4m3"):
        x_exp = mx_block_exponent(amaxes, elem, "rceil").double()
        ratio = amaxes.double() / torch.exp2(x_exp)
        assert (ratio <= ELEMS[elem][1]).all() and (ratio * 2 > ELEMS[elem][1]).all()


def test_scale_uses_the_element_range() -> None:
    """Failure mode 2: a scale of floor(log2 amax) + bias alone underflows small members."""
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1] = 1.0, 2.0**-12
    buggy = to_e4m3(x / 2.0 ** math.floor(math.log2(1.0)))  # block max ~1, 2^-12 -> 0
    assert buggy.float()[0, 1].item() == 0.0
    for rule in RULES:
        deq = dequantize_mx(*quantize_mx(x, "e4m3", rule), "e4m3")
        assert torch.equal(deq, x)  # 2^-12 survives exactly
    y = torch.zeros(1, 32)
    y[0, 0], y[0, 1] = 1.0, 0.2
    assert encode_e2m1(y[0, 1:2]).item() == 0  # the buggy E2M1 scale 2^0 loses 0.2
    deq = dequantize_mx(*quantize_mx(y, "e2m1"), "e2m1")
    assert deq[0, 1].item() == 0.25  # 0.2 * 4 = 0.8 -> 1 -> 0.25


def test_exponent_of_ratio_not_ratio_of_exponents() -> None:
    """Failure mode 3: floor(log2(a/b)) != floor(log2 a) - floor(log2 b)."""
    # E2M1, amax 7: ceil(log2(7/6)) = 1, but floor(log2 7) - floor(log2 6) = 0 (clips 7);
    # amax 4: ceil(log2(4/6)) = 0, but ceil(log2 4) - ceil(log2 6) = -1 (clips 4 -> 8).
    for amax, wrong in (
        (7.0, math.floor(math.log2(7)) - math.floor(math.log2(6))),
        (4.0, math.ceil(math.log2(4)) - math.ceil(math.log2(6))),
    ):
        got = mx_block_exponent(torch.tensor(amax), "e2m1", "rceil").item()
        assert got == math.ceil(math.log2(amax / 6)) != wrong
    # E4M3, amax 500: ceil(log2(500/448)) = 1, floor(log2 500) - floor(log2 448) = 0
    assert mx_block_exponent(torch.tensor(500.0), "e4m3", "rceil").item() == 1


def test_guards_nan_inf_and_clamp() -> None:
    amax = torch.tensor([0.0, 1e-45, 3e38, float("inf")])
    for rule in RULES:
        got = mx_block_exponent(amax, "e2m1", rule).tolist()
        assert got[0] == got[1] == -127 and got[3] == 127
    x = torch.randn(2, 64)
    x[0, 3] = float("nan")
    x[1, 40] = float("inf")
    data, scales = quantize_mx(x, "e2m1")
    assert scales[0, 0].item() == 255 and scales[1, 1].item() == 254
    deq = dequantize_mx(data, scales, "e2m1")
    assert deq[0, :32].isnan().all() and not deq[0, 32:].isnan().any()
    # the Inf saturates to 6 * 2^127, which overflows float32 back to Inf; the rest is finite
    assert deq[1, 40].item() == float("inf") and torch.isfinite(deq[1, :40]).all()


def test_ragged_k_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"K=40 .* block size 32"):
        quantize_mx(torch.randn(2, 40), "e2m1")


@pytest.mark.parametrize("elem", ["e2m1", "e4m3"])
def test_round_trip_bounds_and_shapes(elem: Any) -> None:
    x = random_blocks(16, 4, seed=8, lo=-20, hi=20).reshape(2, 8, 128)
    data, scales = quantize_mx(x.bfloat16(), elem)
    assert scales.shape == (2, 8, 4) and scales.dtype == torch.uint8
    assert data.shape == ((2, 8, 64) if elem == "e2m1" else (2, 8, 128))
    deq = dequantize_mx(data, scales, elem, dtype=torch.float64)
    step = decode_e8m0(scales).double().repeat_interleave(32, dim=-1)  # 2^X per element
    err = (deq - x.bfloat16().double()).abs()
    if elem == "e2m1":  # half the largest gap (4 -> 6) is one unit of 2^X
        assert (err <= step).all()
    else:  # 3 mantissa bits: half an ulp is 2^-4 relative; subnormals 2^-10 of the scale
        assert (err <= x.bfloat16().double().abs() / 16 + step * 2.0**-10).all()
