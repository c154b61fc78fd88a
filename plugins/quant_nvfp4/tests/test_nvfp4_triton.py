"""``nvfp4-triton`` against the reference (``kernelbay.formats.dequantize_nvfp4`` + matmul in
float32): in Triton's interpreter on CPU (tiny ragged shapes), and on CUDA (``gpu``).

Tolerance: the kernel rounds each dequantized weight to the activation dtype (as
``nvfp4-emulation`` does) and rounds its fp32 sum to the output dtype, while the reference
keeps both in float32. Each rounding moves a value by at most one unit roundoff ``u``
relative, so ``|y - y_ref| <= 2u * (|x| @ |W|^T) + (fp32 summation error)``; the test allows
``4u * (|x| @ |W|^T) + 1e-6``, with ``u = 2^-7`` for bf16 (Triton's interpreter truncates
instead of rounding to nearest, which doubles bf16's 2^-8) and 2^-10 for fp16. A wrong
nibble, scale or K offset changes single products by whole steps of the E2M1 grid and
breaks this bound.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from kernelbay.device import parse_device
from kernelbay.formats import dequantize_nvfp4, quantize_nvfp4
from kernelbay.requests import LinearRequest
from kernelbay_quant_nvfp4.linear_triton import Nvfp4TritonLinear
from kernelbay_quant_nvfp4.schemes import nvfp4_scheme
from kernelbay_quant_nvfp4.triton_configs import CANDIDATES, KernelConfig

W4A16 = nvfp4_scheme("modelopt", w4a4=False)
W4A4 = nvfp4_scheme("modelopt", w4a4=True)
UNIT = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


@pytest.fixture
def interpret(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Triton's interpreter for this test only (kernels() re-imports the kernel module when
    the setting changes, so later tests get compiled kernels again)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


def _check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
           bias: torch.Tensor | None) -> None:
    want = x.float() @ w.T + (0 if bias is None else bias.float())
    bound = 4 * UNIT[x.dtype] * (x.float().abs() @ w.abs().T) + 1e-6
    if bias is not None:
        bound = bound + 4 * UNIT[x.dtype] * bias.float().abs()
    err = (got.float() - want).abs()
    assert got.dtype == x.dtype and got.shape == want.shape
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()}"


def _layer(method: Nvfp4TritonLinear, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    layer = torch.nn.Module()
    method.create_weights(layer, device=tensors["weight"].device)
    for name, value in tensors.items():
        getattr(layer, name).data.copy_(value)
    method.process_weights_after_loading(layer)
    return layer


def _weights(n: int, k: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    w = torch.randn(n, k, generator=gen) * torch.logspace(-4, 0, k)  # some tiny blocks
    w[0] = 0.0  # an all-zero row: block scales 1.0, codes 0
    packed, scales, g = quantize_nvfp4(w)
    return {"weight": packed, "weight_scale": scales, "weight_scale_2": g}


def _edge_scales(tensors: dict[str, torch.Tensor]) -> None:
    """Zero, subnormal and maximal E4M3 block scales in place (bits 0x00, 0x01, 0x07, 0x7E)."""
    bits = tensors["weight_scale"].view(torch.uint8)
    bits[1, 0] = 0x00
    bits[1, -1] = 0x01
    bits[-1, 0] = 0x07
    bits[-1, -1] = 0x7E


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "k"), [(40, 272), (17, 48)])
@pytest.mark.parametrize("bias", [False, True])
def test_interpreter_matches_reference(interpret: None, dtype: torch.dtype, n: int, k: int,
                                       bias: bool) -> None:
    gen = torch.Generator().manual_seed(n + k + bias)
    tensors = _weights(n, k, gen)
    _edge_scales(tensors)
    if bias:
        tensors["bias"] = torch.randn(n, generator=gen).to(dtype)
    method = Nvfp4TritonLinear(LinearRequest(k, n, W4A16, str(dtype)[6:], bias))
    layer = _layer(method, tensors)
    w = dequantize_nvfp4(tensors["weight"], tensors["weight_scale"], tensors["weight_scale_2"])
    for m in (1, 3, 17):
        x = torch.randn(m, k, generator=gen).to(dtype)
        _check(method.apply(layer, x), x, w, tensors.get("bias"))
    x3 = torch.randn(2, 3, k, generator=gen).to(dtype)
    got = method.apply(layer, x3)
    assert got.shape == (2, 3, n)
    _check(got.reshape(6, n), x3.reshape(6, k), w, tensors.get("bias"))
    assert torch.equal(method.dequantized_weight(layer), w.to(dtype))


@pytest.mark.parametrize("config", [KernelConfig("split3", "fused", 16, 16, 32, 3, 4, 1),
                                    KernelConfig("nosplit", "fused", 32, 32, 64, 1, 4, 1),
                                    KernelConfig("dequant", "dequant")], ids=str)
def test_interpreter_every_path(interpret: None, config: KernelConfig) -> None:
    """Split-K with a K not a multiple of the tile (272 = 8.5 tiles of 32), no split, and the
    dequantize-then-F.linear path, all against the reference."""
    from kernelbay_quant_nvfp4.linear_triton import run_config
    from kernelbay_quant_nvfp4.triton_kernels import dequantize_nvfp4_triton

    gen = torch.Generator().manual_seed(7)
    tensors = _weights(24, 272, gen)
    _edge_scales(tensors)
    w = dequantize_nvfp4(tensors["weight"], tensors["weight_scale"], tensors["weight_scale_2"])
    assert torch.equal(dequantize_nvfp4_triton(tensors["weight"], tensors["weight_scale"],
                                               tensors["weight_scale_2"], torch.float32), w)
    bias = torch.randn(24, generator=gen).to(torch.float16)
    for m in (1, 17):
        x = torch.randn(m, 272, generator=gen).to(torch.float16)
        got = run_config(config, x, tensors["weight"], tensors["weight_scale"],
                         tensors["weight_scale_2"].reshape(1), bias)
        _check(got, x, w, bias)


def test_can_implement_reasons() -> None:
    req = LinearRequest(4096, 4096, W4A4, "bfloat16")
    ok = Nvfp4TritonLinear.can_implement(req, parse_device("sm_90"))
    assert ok.accepted and "input_scale is not used" in ok.describe()
    assert Nvfp4TritonLinear.can_implement(LinearRequest(64, 32, W4A16), parse_device("sm_80"))
    cases = {
        "compute capability >= 8.0": (req, "sm_75"),
        "CUDA (compute capability >= 8.0) or ROCm GPU": (req, "cpu"),
        "activation dtype": (LinearRequest(4096, 4096, W4A16, "float32"), "sm_90"),
        "K=4104 is not a multiple": (LinearRequest(4104, 64, W4A16), "sm_90"),
    }
    for needle, (request, spec) in cases.items():
        verdict = Nvfp4TritonLinear.can_implement(request, parse_device(spec))
        assert not verdict.accepted and needle in verdict.reason, verdict.reason
    moe = LinearRequest(64, 32, W4A16, num_experts=4)
    assert not Nvfp4TritonLinear.can_implement(moe, parse_device("sm_90")).applicable


def test_nan_scale_rejected_naming_the_tensor() -> None:
    tensors = _weights(16, 32, torch.Generator().manual_seed(0))
    tensors["weight_scale"].view(torch.uint8)[3, 1] = 0x7F  # E4M3 NaN
    method = Nvfp4TritonLinear(LinearRequest(32, 16, W4A16))
    with pytest.raises(ValueError, match="weight_scale has 1 NaN/Inf"):
        _layer(method, tensors)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "k"), [(4096, 4096), (1000, 3088), (8192, 28672)])
def test_cuda_every_config_matches_reference(dtype: torch.dtype, n: int, k: int) -> None:
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
    from kernelbay_quant_nvfp4.linear_triton import run_config

    gen = torch.Generator().manual_seed(n ^ k)
    tensors = {name: t.cuda() for name, t in _weights(n, k, gen).items()}
    _edge_scales(tensors)
    w = dequantize_nvfp4(tensors["weight"], tensors["weight_scale"], tensors["weight_scale_2"])
    glob = tensors["weight_scale_2"].reshape(1)
    for m in (1, 4, 16, 64, 257):
        x = torch.randn(m, k, generator=gen).to(dtype).cuda()
        for config in CANDIDATES:
            got = run_config(config, x, tensors["weight"], tensors["weight_scale"], glob, None)
            _check(got, x, w, None)
    method = Nvfp4TritonLinear(LinearRequest(k, n, W4A16, str(dtype)[6:]))
    layer = _layer(method, tensors)
    x = torch.randn(5, k, generator=gen).to(dtype).cuda()
    _check(method.apply(layer, x), x, w, None)
