"""The Triton MX kernels against the one reference (``kernelbay.formats.mx``): the dynamic
quantizer and the fused SwiGLU quantizer byte for byte, the MXFP4 GEMM against the
reference dequantization + a float32 matmul within float32 summation error.

Without a GPU these run under ``TRITON_INTERPRET=1`` (conftest) on tiny ragged shapes; the
``gpu`` tests repeat them with realistic shapes on CUDA.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from kernelbay.formats import dequantize_mx, quantize_mx, repack_e2m1_words

pytest.importorskip("triton")

ELEMS = ("e2m1", "e4m3")
RULES = ("floor", "even", "rceil")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":  # the kernels run under Triton's interpreter (conftest)
    pytestmark = pytest.mark.triton_interpreter


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def blocks(rows: int, n_blocks: int, seed: int, lo: int = -30, hi: int = 30) -> torch.Tensor:
    """Gaussian blocks of 32 with per-block magnitudes 2^U(lo, hi)."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.randint(lo, hi, (rows, n_blocks, 1), generator=g).float())
    return (torch.randn(rows, n_blocks, 32, generator=g) * mag).reshape(rows, n_blocks * 32)


def edge_blocks() -> torch.Tensor:
    """One row per edge case, 64 wide (two blocks)."""
    rows = []
    z = torch.zeros(64)
    rows.append(z.clone())  # all zeros (scale byte 0 for every rule)
    r = z.clone()
    r[0], r[1], r[2] = -0.0, 2.0**-140, -(2.0**-130)  # fp32 subnormals only
    rows.append(r)
    r = torch.linspace(-7.0, 7.0, 64)  # amax 7: floor clips, even/rceil do not agree
    rows.append(r)
    r = torch.full((64,), 2.0**-12)
    r[0], r[33] = 1.0, -448.0 * 2.0**20  # small members next to the block max (subnormals)
    rows.append(r)
    r = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 8)  # E2M1 ties
    rows.append(r * torch.tensor([1.0, -1.0]).repeat(32))
    r = torch.full((64,), 3.4028234663852886e38)  # ±float32 max
    r[1::2] *= -1
    rows.append(r)
    r = torch.randn(64, generator=torch.Generator().manual_seed(3))
    r[5], r[40] = float("inf"), -float("inf")  # Inf: X = 127, saturates
    rows.append(r)
    r = torch.tensor([6.0 * 2.0**e for e in range(-64, 64, 2)])  # ±max element * 2^e
    rows.append(torch.cat([r[:32], -r[32:]]))
    r = torch.tensor([1.9375 * 2.0**e for e in range(-40, 24)])  # 'even' carry points
    rows.append(r)
    return torch.stack(rows)


@pytest.mark.parametrize("elem", ELEMS)
@pytest.mark.parametrize("rule", RULES)
def test_quantizer_matches_reference(elem: Any, rule: Any) -> None:
    from kernelbay_quant_mxfp4_rocm import triton_mx

    x = torch.cat([blocks(5, 2, seed=11), edge_blocks()])
    for inp in (x, x.bfloat16(), x.reshape(7, 2, 64)[:, :, :32]):  # fp32, bf16, 3-D view
        data, scales = triton_mx.quantize_mx(inp.to(DEVICE), elem, rule)
        want_data, want_scales = quantize_mx(inp, elem, rule)
        assert torch.equal(scales.cpu(), want_scales)
        assert torch.equal(_bytes(data).cpu(), _bytes(want_data))


@pytest.mark.parametrize("elem", ELEMS)
def test_quantizer_nan_blocks(elem: Any) -> None:
    from kernelbay_quant_mxfp4_rocm import triton_mx

    x = blocks(3, 3, seed=12)
    x[0, 4] = float("nan")
    x[2, 70] = float("nan")
    data, scales = triton_mx.quantize_mx(x.to(DEVICE), elem, "even")
    want_data, want_scales = quantize_mx(x, elem, "even")
    assert torch.equal(scales.cpu(), want_scales)
    assert scales[0, 0].item() == 255 and scales[2, 2].item() == 255
    nan_block = (want_scales == 255).repeat_interleave(32 if elem == "e4m3" else 16, dim=-1)
    got, want = _bytes(data).cpu(), _bytes(want_data)
    if elem == "e2m1":  # code 7 everywhere in the block, as the reference
        assert torch.equal(got, want)
    else:  # the NaN byte's sign is unspecified; the rest is equal
        assert torch.equal(got[~nan_block], want[~nan_block])
    deq = dequantize_mx(data.cpu(), scales.cpu(), elem)
    assert torch.equal(deq.isnan(), dequantize_mx(want_data, want_scales, elem).isnan())


def test_quantizer_errors_name_the_value() -> None:
    from kernelbay_quant_mxfp4_rocm import triton_mx

    with pytest.raises(ValueError, match=r"'ceil' is not one of \['floor', 'even', 'rceil'\]"):
        triton_mx.quantize_mx(torch.zeros(1, 32), "e2m1", "ceil")
    with pytest.raises(ValueError, match="'e5m2'"):
        triton_mx.quantize_mx(torch.zeros(1, 32), "e5m2", "even")
    with pytest.raises(ValueError, match=r"K a multiple of 32.*\(2, 40\)"):
        triton_mx.quantize_mx(torch.zeros(2, 40), "e2m1", "even")
    data, scales = triton_mx.quantize_mx(torch.zeros(0, 64), "e2m1", "even")
    assert data.shape == (0, 32) and scales.shape == (0, 2)


@pytest.mark.parametrize("elem", ELEMS)
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # exp(200): inf, silu -> -0
def test_swiglu_quantizer_matches_reference(elem: Any, rule: Any) -> None:
    from kernelbay_quant_mxfp4_rocm import triton_mx
    from kernelbay_quant_mxfp4_rocm.swiglu import swiglu_quantize_mx_reference

    g = torch.Generator().manual_seed(13)
    gate_up = torch.randn(5, 2 * 96, generator=g) * 4  # halves read in place (strided rows)
    gate_up[0, :96] = 0.0
    gate_up[1, 96:] = 0.0
    gate_up[2, 3] = -200.0  # silu underflows towards -0
    gate_up[3, :32] = 2.0**-20  # tiny products: subnormal E4M3 elements
    gate_up[3, 96] = 50.0
    for dtype in (torch.float32, torch.bfloat16):
        gu = gate_up.to(dtype)
        gate, up = gu[:, :96], gu[:, 96:]
        data, scales, h = triton_mx.swiglu_quantize_mx(gate.to(DEVICE), up.to(DEVICE), elem,
                                                       rule, return_h=True)
        want_data, want_scales = swiglu_quantize_mx_reference(gate, up, elem, rule)
        assert torch.equal(scales.cpu(), want_scales)
        assert torch.equal(_bytes(data).cpu(), _bytes(want_data))
        # the quantizer half is exact whatever exp returns; h is silu(g) * u in float32
        q_data, q_scales = quantize_mx(h.cpu(), elem, rule)
        assert torch.equal(scales.cpu(), q_scales)
        assert torch.equal(_bytes(data).cpu(), _bytes(q_data))
        ref_h = F.silu(gate.float()) * up.float()
        assert torch.allclose(h.cpu(), ref_h, rtol=2**-21, atol=0)


def test_swiglu_nan_and_shape_errors() -> None:
    from kernelbay_quant_mxfp4_rocm import triton_mx

    gate = torch.randn(2, 64)
    gate[1, 40] = float("nan")
    _, scales = triton_mx.swiglu_quantize_mx(gate.to(DEVICE), torch.ones(2, 64).to(DEVICE))
    assert scales.cpu().tolist()[1] == [scales[1, 0].item(), 255]
    with pytest.raises(ValueError, match=r"gate has shape \(2, 64\) and up \(2, 32\)"):
        triton_mx.swiglu_quantize_mx(gate, torch.ones(2, 32))


def gemm_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """|y - ref| allowed: K * (2^-22 * (|x| @ |W|^T) + 2^-126), float32 summation error of K
    exact products in any order (<= (K - 1) * 2^-24 relative to the absolute sum) with a
    margin, plus one smallest normal per term where a matmul flushes subnormal products."""
    k = x.shape[-1]
    return k * (2.0**-22 * (x.abs().double() @ w.abs().double().T) + 2.0**-126)


def random_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = blocks(n, k // 32, seed=seed, lo=-8, hi=8)
    return quantize_mx(w, "e2m1", "even")


CONFIGS = [None, (16, 32, 64, 2), (16, 16, 32, 3), (32, 32, 64, 1), (16, 64, 128, 1),
           (16, 32, 64, 2, 4, 3, "scaled"), (16, 16, 32, 1, 4, 3, "dequant"),
           (16, 32, 64, 1, 4, 3, "pairs"), (32, 16, 32, 2, 4, 3, "pairs"),
           (16, 32, 64, 2, 4, 3, "repacked"), (32, 16, 32, 1, 4, 3, "repacked"),
           (16, 32, 64, 2, 4, 3, "fragment"), (32, 16, 32, 1, 4, 3, "fragment")]


def weight_for(config: Any, packed: torch.Tensor) -> torch.Tensor:
    """The weight in the layout ``config`` reads (``triton_gemm.layout_weight``; no config:
    the checkpoint bytes)."""
    from kernelbay_quant_mxfp4_rocm.triton_gemm import READABLE, layout_weight

    path = getattr(config, "path", "decode")
    return layout_weight(packed, next(lay for lay, paths in READABLE.items() if path in paths))


@pytest.mark.parametrize("shape", [(1, 40, 96), (5, 33, 128), (16, 16, 64), (19, 48, 160)])
@pytest.mark.parametrize("cfg", CONFIGS)
def test_gemm_w4a16_matches_reference(shape: tuple[int, int, int], cfg: Any) -> None:
    from kernelbay_quant_mxfp4_rocm.triton_gemm import GemmConfig, mxfp4_gemm

    m, n, k = shape
    wp, ws = random_weight(n, k, seed=m + n)
    w = dequantize_mx(wp, ws, "e2m1")
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).bfloat16()
    config = None if cfg is None else GemmConfig(*cfg)
    wp = weight_for(config, wp)
    y = mxfp4_gemm(x.to(DEVICE), wp.to(DEVICE), ws.to(DEVICE), out_dtype=torch.float32,
                   config=config).cpu()
    ref = x.float() @ w.T
    assert ((y.double() - ref.double()).abs() <= gemm_bound(x.float(), w)).all()
    y16 = mxfp4_gemm(x.to(DEVICE), wp.to(DEVICE), ws.to(DEVICE), config=config).cpu()
    assert y16.dtype == torch.bfloat16 and torch.equal(y16, y.bfloat16())


@pytest.mark.parametrize("elem", ELEMS)
def test_gemm_mx_activations_match_reference(elem: Any) -> None:
    from kernelbay_quant_mxfp4_rocm import triton_mx
    from kernelbay_quant_mxfp4_rocm.triton_gemm import GemmConfig, mxfp4_gemm

    m, n, k = 7, 40, 128
    wp, ws = random_weight(n, k, seed=21)
    w = dequantize_mx(wp, ws, "e2m1")
    x = blocks(m, k // 32, seed=22, lo=-10, hi=10)
    x[0] = 0.0
    xd, xs = triton_mx.quantize_mx(x.to(DEVICE), elem, "even")
    xq = dequantize_mx(xd.cpu(), xs.cpu(), elem)
    for config in (None, GemmConfig(16, 16, 32, 2), GemmConfig(16, 16, 64, 1, 4, 3, "pairs")):
        y = mxfp4_gemm(xd, wp.to(DEVICE), ws.to(DEVICE), x_scale=xs, out_dtype=torch.float32,
                       config=config).cpu()
        ref = xq @ w.T
        assert ((y.double() - ref.double()).abs() <= gemm_bound(xq, w)).all()


@pytest.mark.parametrize("fast", [False, True])
def test_gemm_scale_extremes_and_nan(fast: bool, path: str = "decode", low: int = 0,
                                     high: int | None = None) -> None:
    from kernelbay_quant_mxfp4_rocm.triton_gemm import (
        GemmConfig,
        mxfp4_gemm,
        prepare_weight_scales,
    )

    g = torch.Generator().manual_seed(23)
    n, k = 24, 64
    wp = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    top = high or (128 if fast else 252)  # 252: 6 * 2^125 is finite (the decode test has inf)
    ws = torch.randint(low, top + 1, (n, k // 32), generator=g, dtype=torch.uint8)
    ws[0] = low  # 2^-127: subnormal dequantized weights
    ws[1] = top  # 2^125 (general decode) / 2^1 (the single-multiply one's limit)
    x = torch.randn(3, k, generator=g).bfloat16()
    if top > 200:
        x = x * 2.0**-100  # keep the 2^125 rows' sums finite
    config = GemmConfig(16, 32, 64, 1, 4, 3, path)

    def check(nan_rows: list[int]) -> None:
        scale_max = prepare_weight_scales(ws)
        # a NaN byte is the largest: it turns the single-multiply decode (no NaN select) off
        assert scale_max == (255 if nan_rows else top) or path != "decode"
        w = dequantize_mx(wp, ws, "e2m1")
        y = mxfp4_gemm(x.to(DEVICE), weight_for(config, wp).to(DEVICE), ws.to(DEVICE),
                       out_dtype=torch.float32, scale_max=scale_max, config=config).cpu()
        ref = x.float() @ w.T
        finite = [r for r in range(n) if r not in nan_rows]
        assert y[:, nan_rows].isnan().all() and not y[:, finite].isnan().any()
        ok = ~ref.isnan()
        assert ((y - ref).abs()[ok].double() <= gemm_bound(x.float(), w.nan_to_num())[ok]).all()

    check([])
    ws[2, 1] = 255  # NaN scale: NaN outputs in row 2, whatever the other bytes allow
    check([2])
    assert prepare_weight_scales(torch.full((2, 2), 255, dtype=torch.uint8)) == 255
    assert prepare_weight_scales(torch.zeros((0, 2), dtype=torch.uint8)) == 0
    with pytest.raises(TypeError, match="weight_scale: want E8M0 bytes as uint8"):
        prepare_weight_scales(ws.int())


def all_codes_weight(scale_bytes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One row per scale byte, each row every E2M1 code pair (256 bytes = K 512), so every
    code meets every byte in every position of a 32-block."""
    n = scale_bytes.numel()
    wp = torch.arange(256, dtype=torch.uint8).repeat(n, 1)
    wp = torch.stack([row.roll(int(i) * 7) for i, row in enumerate(wp)])
    return wp, scale_bytes.to(torch.uint8)[:, None].repeat(1, 16)


@pytest.mark.parametrize("fast", [False, True])
def test_decode_every_code_and_scale_byte(fast: bool) -> None:
    """The in-register decode (``dequantize_weight``: the GEMM's decode on the device's
    path: PTX on CUDA, plain Triton elsewhere) equals ``dequantize_mx`` bit for bit for
    every code x every scale byte (0..254; 255 is NaN), incl. subnormal and overflowing
    products and signed zeros."""
    from kernelbay_quant_mxfp4_rocm.triton_gemm import dequantize_weight

    top = 128 if fast else 255
    wp, ws = all_codes_weight(torch.arange(0, top + 1))
    want = dequantize_mx(wp, ws, "e2m1")
    got = dequantize_weight(wp.to(DEVICE), ws.to(DEVICE),
                            scale_max=top if fast else None).cpu()
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan) and bool(nan[-1].all()) == (top == 255)
    # bit for bit (signed zeros, subnormals, +-inf for 6 * 2^127) outside NaN
    assert torch.equal(got.float()[~nan].view(torch.int32), want[~nan].view(torch.int32))


@pytest.mark.parametrize("elem", ELEMS)
def test_decode_activations_bit_exact(elem: Any, rows: int = 5) -> None:
    """``decode_activations`` (the GEMM's once-per-call MX activation decode) equals
    ``dequantize_mx(...).to(bfloat16)`` bit for bit for every code/byte value against scale
    bytes 0..255 (subnormal, overflowing and NaN products, signed zeros), ragged M."""
    from kernelbay_quant_mxfp4_rocm.triton_gemm import decode_activations

    g = torch.Generator().manual_seed(41)
    k = 512 if elem == "e2m1" else 1024  # every byte value in every row
    cols = k // 2 if elem == "e2m1" else k
    data = torch.stack([torch.arange(256, dtype=torch.uint8).repeat(cols // 256).roll(7 * r)
                        for r in range(rows)])
    scales = torch.randint(0, 256, (rows, k // 32), generator=g, dtype=torch.uint8)
    scales[0, :3] = torch.tensor([0, 254, 255], dtype=torch.uint8)
    scales[1, :3] = torch.tensor([1, 127, 8], dtype=torch.uint8)
    ref_in = data if elem == "e2m1" else data.view(torch.float8_e4m3fn)
    want = dequantize_mx(ref_in, scales, elem).to(torch.bfloat16)
    got = decode_activations(ref_in.to(DEVICE), scales.to(DEVICE)).cpu()
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan) and bool(nan.any())
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))
    with pytest.raises(ValueError, match="decode_activations: x_scale must be uint8"):
        decode_activations(ref_in, scales.int())


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("path", ["pairs", "repacked", "fragment"])
def test_pairs_decode_every_code_exact(fast: bool, path: str, step: int = 23) -> None:
    """The word paths (``pairs``: 32-bit words, K in ``PAIR_ORDER``, activations loaded to
    match; ``repacked``: the repacked words in K order; ``fragment``: the fragment-order words,
    product transposed) with one-hot activations return the
    reference's weight values exactly: every code in every position against scale bytes
    0..252 (every ``step``-th; no 6 * 2^127 = inf, whose product with the zeros is NaN), plus
    extreme and NaN scales in the GEMM test."""
    from kernelbay_quant_mxfp4_rocm.triton_gemm import GemmConfig, mxfp4_gemm

    top = 128 if fast else 252
    wp, ws = all_codes_weight(torch.tensor([*range(0, top, step), top]))
    w = dequantize_mx(wp, ws, "e2m1")
    k = w.shape[1]
    x = torch.eye(k, dtype=torch.bfloat16)[:: 1 if DEVICE == "cuda" else 5]
    config = GemmConfig(16, 16, 64, 2, 4, 3, path)
    y = mxfp4_gemm(x.to(DEVICE), weight_for(config, wp).to(DEVICE), ws.to(DEVICE),
                   out_dtype=torch.float32, config=config,
                   scale_max=top if fast else None).cpu()
    assert torch.equal(y, x.float() @ w.T)
    test_gemm_scale_extremes_and_nan(fast, path)
    # the dequantize path reads the word layouts too (decode_kernel, REPACKED / FRAGMENT)
    from kernelbay_quant_mxfp4_rocm.triton_gemm import dequantize_weight

    got = dequantize_weight(weight_for(config, wp).to(DEVICE), ws.to(DEVICE),
                            scale_max=top if fast else None).cpu()
    assert torch.equal(got.view(torch.int16), w.bfloat16().view(torch.int16))


def test_weight_layout_and_config_must_agree() -> None:
    """A repacked weight with a checkpoint-layout config, and the other way round, are
    errors naming the path and the paths that can read the weight."""
    from kernelbay_quant_mxfp4_rocm.triton_gemm import GemmConfig, mxfp4_gemm

    wp, ws = random_weight(16, 64, seed=3)
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"'pairs' cannot read a weight in the repacked layout; "
                                         r"paths for it: \['repacked', 'dequant'\]"):
        mxfp4_gemm(x, repack_e2m1_words(wp), ws, config=GemmConfig(16, 16, 64, 1, 4, 3, "pairs"))
    with pytest.raises(ValueError, match="'repacked' cannot read a weight in the checkpoint"):
        mxfp4_gemm(x, wp, ws, config=GemmConfig(16, 16, 64, 1, 4, 3, "repacked"))
    fragment = repack_e2m1_words(wp, "fragment")
    with pytest.raises(ValueError, match=r"'repacked' cannot read a weight in the fragment "
                                         r"layout; paths for it: \['fragment', 'dequant'\]"):
        mxfp4_gemm(x, fragment, ws, config=GemmConfig(16, 16, 64, 1, 4, 3, "repacked"))
    with pytest.raises(ValueError, match=r"int32 \[N, K/32, 4\], got torch.int16"):
        mxfp4_gemm(x, wp.view(torch.int16), ws)
    from kernelbay_quant_mxfp4_rocm.triton_gemm import default_config, layout_weight

    with pytest.raises(ValueError, match=r"weight layout 'mma'; valid: \('checkpoint', "
                                         r"'repacked', 'fragment'\)"):
        default_config(16, 16, 64, layout="mma")
    with pytest.raises(ValueError, match="weight layout 'mma'"):
        layout_weight(wp, "mma")


def test_config_names_round_trip() -> None:
    """``GemmConfig.parse`` reads what ``describe`` writes (every candidate, a register cap);
    a malformed name or an unknown path is an error naming the text and the form."""
    from kernelbay_quant_mxfp4_rocm.triton_gemm import GemmConfig, candidate_configs

    capped = GemmConfig(16, 64, 256, 4, 4, 3, "fragment", max_registers=96)
    assert capped.describe() == "m16n64k256s4w4p3r96-fragment"
    for cfg in [capped, *candidate_configs(16, 8192, 8192), *candidate_configs(64, 512, 512)]:
        assert GemmConfig.parse(cfg.describe()) == cfg
    for bad in ("m16n64k256s4w4", "m16n64k256s4w4p3-mma", "n64k256w4s3"):
        with pytest.raises(ValueError, match=rf"config '{bad}'; expected m<M>n<N>k<K>.*"
                                             r"'fragment'"):
            GemmConfig.parse(bad)
    # the cap is a compile option of the CUDA backend alone: refused here, named
    from kernelbay_quant_mxfp4_rocm.triton_gemm import mxfp4_gemm

    wp, ws = random_weight(16, 64, seed=4)
    with pytest.raises(ValueError, match=r"max_registers=96 applies to NVIDIA GPUs only, "
                                         r"between 24 and 255; the activations are on cpu"):
        mxfp4_gemm(torch.zeros(2, 64, dtype=torch.bfloat16), wp, ws,
                   config=GemmConfig(16, 16, 64, 1, 4, 3, "decode", max_registers=96))


def test_decode_subnormal_scale_in_the_gemm() -> None:
    """Bytes 0 and 1 (2^-127, 2^-126) decode to bf16 subnormals, 252 to 6 * 2^125."""
    from kernelbay_quant_mxfp4_rocm.triton_gemm import mxfp4_gemm

    wp, ws = all_codes_weight(torch.tensor([0, 1, 127, 200, 252]))
    w = dequantize_mx(wp, ws, "e2m1")
    x = torch.zeros(2, 512, dtype=torch.bfloat16)
    x[0, ::2] = 2.0**-20  # float32 partial sums of the 2^125 row stay finite
    x[1, ::3] = 2.0**-3
    y = mxfp4_gemm(x.to(DEVICE), wp.to(DEVICE), ws.to(DEVICE), out_dtype=torch.float32).cpu()
    ref = x.double() @ w.double().T
    assert ((y.double() - ref).abs() <= gemm_bound(x.float(), w.nan_to_num())).all()


def test_gemm_argument_errors() -> None:
    from kernelbay_quant_mxfp4_rocm.triton_gemm import mxfp4_gemm

    wp, ws = random_weight(16, 64, seed=1)
    with pytest.raises(ValueError, match=r"must be bfloat16.*float16"):
        mxfp4_gemm(torch.zeros(2, 64, dtype=torch.float16), wp, ws)
    with pytest.raises(ValueError, match=r"64 columns for K=64, got \(2, 96\)"):
        mxfp4_gemm(torch.zeros(2, 96, dtype=torch.bfloat16), wp, ws)
    with pytest.raises(ValueError, match=r"weight_scale must be uint8 \[16, 2\]"):
        mxfp4_gemm(torch.zeros(2, 64, dtype=torch.bfloat16), wp, ws[:, :1])
    assert mxfp4_gemm(torch.zeros(0, 64, dtype=torch.bfloat16), wp, ws).shape == (0, 16)


# ---------------------------------------------------------------------------------------
# realistic shapes on a GPU


@pytest.mark.gpu
@pytest.mark.parametrize("elem", ELEMS)
@pytest.mark.parametrize("rule", RULES)
def test_gpu_quantizer_realistic(elem: Any, rule: Any) -> None:
    from kernelbay_quant_mxfp4_rocm import triton_mx

    x = torch.cat([blocks(300, 224, seed=31, lo=-60, hi=60), edge_blocks().repeat(1, 112)])
    for inp in (x, x.bfloat16()):
        data, scales = triton_mx.quantize_mx(inp.cuda(), elem, rule)
        want_data, want_scales = quantize_mx(inp, elem, rule)
        assert torch.equal(scales.cpu(), want_scales)
        assert torch.equal(_bytes(data).cpu(), _bytes(want_data))


@pytest.mark.gpu
@pytest.mark.parametrize("elem", ELEMS)
def test_gpu_swiglu_realistic(elem: Any) -> None:
    from kernelbay_quant_mxfp4_rocm import triton_mx
    from kernelbay_quant_mxfp4_rocm.swiglu import swiglu_quantize_mx_reference

    gate_up = torch.randn(64, 2 * 14336, generator=torch.Generator().manual_seed(32)) * 3
    gate_up = gate_up.bfloat16().cuda()
    gate, up = gate_up[:, :14336], gate_up[:, 14336:]
    data, scales, h = triton_mx.swiglu_quantize_mx(gate, up, elem, "even", return_h=True)
    # exact: the quantizer on the kernel's own float32 product
    q_data, q_scales = quantize_mx(h.cpu(), elem, "even")
    assert torch.equal(scales.cpu(), q_scales)
    assert torch.equal(_bytes(data).cpu(), _bytes(q_data))
    ref_h = (F.silu(gate.float()) * up.float()).cpu()
    # Triton's exp and float32 division may be approximate on a GPU (a few ulps, growing
    # with |gate| through exp(-g)); a wrong formula is off by far more
    assert torch.allclose(h.cpu(), ref_h, rtol=2**-16, atol=0)
    # against the reference end to end: equal unless exp differs by an ulp at a rounding
    # boundary (on CUDA torch and Triton may use different exp implementations)
    want_data, want_scales = swiglu_quantize_mx_reference(gate.cpu(), up.cpu(), elem, "even")
    same = (_bytes(data).cpu() == _bytes(want_data)).float().mean().item()
    same_scales = (scales.cpu() == want_scales).float().mean().item()
    assert same >= 0.9999 and same_scales >= 0.9999, (same, same_scales)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 7, 16, 64, 256])
def test_gpu_gemm_realistic(m: int) -> None:
    from kernelbay_quant_mxfp4_rocm import triton_mx
    from kernelbay_quant_mxfp4_rocm.triton_gemm import mxfp4_gemm

    n, k = 2048, 8192
    wp, ws = random_weight(n, k, seed=33)
    w = dequantize_mx(wp, ws, "e2m1").cuda()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(34)).bfloat16().cuda()
    wp, ws = wp.cuda(), ws.cuda()
    y = mxfp4_gemm(x, wp, ws, out_dtype=torch.float32)
    ref = torch.matmul(x.double(), w.double().T)
    assert ((y.double() - ref).abs() <= gemm_bound(x.float(), w)).all()
    xd, xs = triton_mx.quantize_mx(x, "e2m1", "even")
    xq = dequantize_mx(xd, xs, "e2m1")
    y4 = mxfp4_gemm(xd, wp, ws, x_scale=xs, out_dtype=torch.float32)
    assert ((y4.double() - xq.double() @ w.double().T).abs() <= gemm_bound(xq, w)).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available()
                    or torch.cuda.get_device_capability() < (9, 0),
                    reason="programmatic launches need compute capability 9.0+")
@pytest.mark.parametrize("m,split", [(1, 4), (4, 1), (16, 4)])
def test_gpu_gemm_programmatic_launches_wait(m: int, split: int,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Launched as programmatic dependents (``KERNELBAY_PDL=1``), chained fragment-path GEMMs
    and their split-K sums read their activations only once the kernel before them has
    finished: the bits of plain launches, eagerly and in a CUDA graph."""
    import functools

    from kernelbay import triton_pdl
    from kernelbay.testing.programmatic import check_programmatic_chain
    from kernelbay_quant_mxfp4_rocm.triton_gemm import GemmConfig, mxfp4_gemm, prepare_weight

    monkeypatch.setenv("KERNELBAY_PDL", "1")
    assert triton_pdl.enabled(torch.device("cuda"))  # else the chain would test plain launches

    config = GemmConfig(16, 64, 256, split, 4, 3, "fragment")
    layers = []
    for seed in range(3):
        wp, ws = random_weight(1024, 1024, seed=40 + seed)
        layers.append(functools.partial(_gemm_layer, mxfp4_gemm, prepare_weight(wp.cuda()),
                                        ws.cuda(), config))
    gen = torch.Generator().manual_seed(m)
    inputs = [torch.randn(m, 1024, generator=gen).bfloat16().cuda() for _ in range(4)]
    check_programmatic_chain(monkeypatch, layers, inputs)


def _gemm_layer(gemm: Any, weight: torch.Tensor, scale: torch.Tensor, config: Any,
                x: torch.Tensor) -> torch.Tensor:
    return gemm(x, weight, scale, config=config)  # type: ignore[no-any-return]


@pytest.mark.gpu
@pytest.mark.parametrize("fast", [False, True])
def test_gpu_decode_every_code_and_scale_byte(fast: bool) -> None:
    """The PTX decode (CUDA's path) bit for bit against the reference."""
    test_decode_every_code_and_scale_byte(fast)
    test_decode_subnormal_scale_in_the_gemm()


@pytest.mark.gpu
@pytest.mark.parametrize("fast", [False, True])
def test_gpu_pairs_decode_every_code_exact(fast: bool) -> None:
    """The ``pairs`` and ``repacked`` PTX decodes on CUDA, every scale byte."""
    test_pairs_decode_every_code_exact(fast, "pairs", step=1)
    test_pairs_decode_every_code_exact(fast, "repacked", step=1)
    test_pairs_decode_every_code_exact(fast, "fragment", step=1)


@pytest.mark.gpu
@pytest.mark.parametrize("elem", ELEMS)
def test_gpu_decode_activations_bit_exact(elem: Any) -> None:
    """The activation decode on CUDA (PTX E2M1 decode, E4M3 kernel) bit for bit."""
    test_decode_activations_bit_exact(elem, rows=37)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["decode", "pairs", "repacked", "fragment", "dequant"])
@pytest.mark.parametrize("fast", [False, True])
def test_gpu_gemm_scale_extremes_and_nan(path: str, fast: bool) -> None:
    test_gemm_scale_extremes_and_nan(fast, path)


@pytest.mark.gpu
def test_gpu_dot_scaled_scale_range() -> None:
    """``tl.dot_scaled`` (the sweep's ``scaled`` path) for scale bytes 100..140 and NaN (the
    range real weights use); the extremes are not claimed for it."""
    test_gemm_scale_extremes_and_nan(False, "scaled", low=100, high=140)


def _gpu_configs() -> list[tuple[int, Any]]:
    from kernelbay_quant_mxfp4_rocm.triton_gemm import candidate_configs, default_config

    n, k = 2048, 8192
    out = []
    for m in (16, 256):
        cfgs = [default_config(m, n, k), default_config(m, n, k, layout="repacked"),
                default_config(m, n, k, layout="fragment"), *candidate_configs(m, n, k)]
        out += [(m, c) for c in dict.fromkeys(cfgs)]
    return out


@pytest.mark.gpu
def test_gpu_gemm_with_a_register_cap() -> None:
    """A config with ``max_registers`` gives the reference's result, and the cap reaches the
    compiler (the build's PTX carries the ``.maxnreg`` directive ptxas allocates under)."""
    from kernelbay_quant_mxfp4_rocm.triton_gemm import GemmConfig, mxfp4_gemm

    n, k, m = 512, 2048, 5
    wp, ws = quantize_mx(blocks(n, k // 32, seed=36, lo=-12, hi=-2), "e2m1", "even")
    w = dequantize_mx(wp, ws, "e2m1").cuda()
    cfg = GemmConfig(16, 64, 256, 2, 4, 3, "fragment", max_registers=96)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(5)).bfloat16().cuda()
    y = mxfp4_gemm(x, weight_for(cfg, wp).cuda(), ws.cuda(), out_dtype=torch.float32,
                   config=cfg)
    assert ((y.double() - x.double() @ w.double().T).abs() <= gemm_bound(x.float(), w)).all()
    from kernelbay_quant_mxfp4_rocm import triton_gemm

    # the PTX of the build carries the cap (the directive ptxas allocates under)
    builds = [c for cache in triton_gemm._mxfp4_gemm_kernel.device_caches.values()
              for c in cache[0].values()]
    assert any(".maxnreg 96" in c.asm["ptx"] for c in builds)


@pytest.mark.gpu
@pytest.mark.parametrize("case", _gpu_configs(), ids=lambda c: f"M{c[0]}-{c[1].describe()}")
def test_gpu_gemm_every_candidate_config(case: tuple[int, Any]) -> None:
    """Every config the benchmark sweep may pick, W4A16 (single-multiply decode; the general
    one runs in ``test_gpu_gemm_realistic``) and W4A4, at a realistic shape with a ragged M
    (one compile per activation kind and config, to keep the GPU run short)."""
    from kernelbay_quant_mxfp4_rocm import triton_mx
    from kernelbay_quant_mxfp4_rocm.triton_gemm import mxfp4_gemm, prepare_weight_scales

    m, cfg = case
    n, k = 2048, 8192
    wp, ws = quantize_mx(blocks(n, k // 32, seed=35, lo=-12, hi=-2), "e2m1", "even")
    w = dequantize_mx(wp, ws, "e2m1").cuda()
    wp, ws = weight_for(cfg, wp).cuda(), ws.cuda()
    top = prepare_weight_scales(ws)
    assert top <= 128  # the single-multiply decode is the one under test
    x = torch.randn(m - 3, k, generator=torch.Generator().manual_seed(m)).bfloat16().cuda()
    ref = torch.matmul(x.double(), w.double().T)
    y = mxfp4_gemm(x, wp, ws, out_dtype=torch.float32, config=cfg, scale_max=top)
    assert ((y.double() - ref).abs() <= gemm_bound(x.float(), w)).all()
    xd, xs = triton_mx.quantize_mx(x, "e2m1", "even")
    xq = dequantize_mx(xd, xs, "e2m1")
    y4 = mxfp4_gemm(xd, wp, ws, x_scale=xs, out_dtype=torch.float32, config=cfg,
                    scale_max=top)
    assert ((y4.double() - xq.double() @ w.double().T).abs() <= gemm_bound(xq, w)).all()
