"""``nvfp4-triton`` in Triton's interpreter on CPU against the reference. Not collected on
its own: ``test_nvfp4_triton.test_interpreter_cases`` runs this file in a child pytest with
``TRITON_INTERPRET=1`` set before triton is imported, so no other test sees the setting.
Tiny ragged shapes: K a multiple of 16 but not of the K tile, N ragged, M = 1, 3, 17."""

from __future__ import annotations

import os

import pytest
import torch
from kernelbay.formats import dequantize_nvfp4
from kernelbay.requests import LinearRequest
from kernelbay_quant_nvfp4.linear_triton import Nvfp4TritonLinear
from kernelbay_quant_nvfp4.schemes import nvfp4_scheme
from kernelbay_quant_nvfp4.triton_configs import KernelConfig
from nvfp4_triton_helpers import check_close, edge_scales, make_layer, nvfp4_weights

W4A16 = nvfp4_scheme("modelopt", w4a4=False)


@pytest.fixture(autouse=True)
def interpreting() -> None:
    """These cases mean nothing without the interpreter."""
    assert os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "k"), [(40, 272), (17, 48)])
@pytest.mark.parametrize("bias", [False, True])
def test_interpreter_matches_reference(dtype: torch.dtype, n: int, k: int,
                                       bias: bool) -> None:
    gen = torch.Generator().manual_seed(n + k + bias)
    tensors = nvfp4_weights(n, k, gen)
    edge_scales(tensors)
    if bias:
        tensors["bias"] = torch.randn(n, generator=gen).to(dtype)
    method = Nvfp4TritonLinear(LinearRequest(k, n, W4A16, str(dtype)[6:], bias))
    layer = make_layer(method, tensors)
    w = dequantize_nvfp4(tensors["weight"], tensors["weight_scale"], tensors["weight_scale_2"])
    for m in (1, 3, 17):
        x = torch.randn(m, k, generator=gen).to(dtype)
        check_close(method.apply(layer, x), x, w, tensors.get("bias"))
    x3 = torch.randn(2, 3, k, generator=gen).to(dtype)
    got = method.apply(layer, x3)
    assert got.shape == (2, 3, n)
    check_close(got.reshape(6, n), x3.reshape(6, k), w, tensors.get("bias"))
    assert torch.equal(method.dequantized_weight(layer), w.to(dtype))


@pytest.mark.parametrize("config", [KernelConfig("split3", "fused", 16, 16, 32, 3, 4, 1),
                                    KernelConfig("nosplit", "fused", 32, 32, 64, 1, 4, 1),
                                    KernelConfig("dequant", "dequant")], ids=str)
def test_interpreter_every_path(config: KernelConfig) -> None:
    """Split-K with a K not a multiple of the tile (272 = 8.5 tiles of 32), no split, and the
    dequantize-then-F.linear path, all against the reference."""
    from kernelbay_quant_nvfp4.linear_triton import run_config
    from kernelbay_quant_nvfp4.triton_kernels import dequantize_nvfp4_triton

    gen = torch.Generator().manual_seed(7)
    tensors = nvfp4_weights(24, 272, gen)
    edge_scales(tensors)
    w = dequantize_nvfp4(tensors["weight"], tensors["weight_scale"], tensors["weight_scale_2"])
    assert torch.equal(dequantize_nvfp4_triton(tensors["weight"], tensors["weight_scale"],
                                               tensors["weight_scale_2"], torch.float32), w)
    bias = torch.randn(24, generator=gen).to(torch.float16)
    for m in (1, 17):
        x = torch.randn(m, 272, generator=gen).to(torch.float16)
        got = run_config(config, x, tensors["weight"], tensors["weight_scale"],
                         tensors["weight_scale_2"].reshape(1), bias)
        check_close(got, x, w, bias)
