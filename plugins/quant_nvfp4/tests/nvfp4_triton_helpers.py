"""Shared pieces of the ``nvfp4-triton`` tests: weights with edge-case block scales and the
error bound against the reference (the bound is explained in ``test_nvfp4_triton``)."""

from __future__ import annotations

import functools
from typing import Any

import torch
from kernelbay.formats import quantize_nvfp4
from kernelbay_quant_nvfp4.linear_triton import Nvfp4TritonLinear, layout_tensors
from kernelbay_quant_nvfp4.triton_configs import KernelConfig, layout_of

UNIT = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def check_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
           bias: torch.Tensor | None) -> None:
    want = x.float() @ w.T + (0 if bias is None else bias.float())
    bound = 4 * UNIT[x.dtype] * (x.float().abs() @ w.abs().T) + 1e-6
    if bias is not None:
        bound = bound + 4 * UNIT[x.dtype] * bias.float().abs()
    err = (got.float() - want).abs()
    assert got.dtype == x.dtype and got.shape == want.shape
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()}"


def make_layer(method: Nvfp4TritonLinear, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    layer = torch.nn.Module()
    method.create_weights(layer, device=tensors["weight"].device)
    for name, value in tensors.items():
        getattr(layer, name).data.copy_(value)
    method.process_weights_after_loading(layer)
    return layer


def nvfp4_weights(n: int, k: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    w = torch.randn(n, k, generator=gen) * torch.logspace(-4, 0, k)  # some tiny blocks
    w[0] = 0.0  # an all-zero row: block scales 1.0, codes 0
    packed, scales, g = quantize_nvfp4(w)
    return {"weight": packed, "weight_scale": scales, "weight_scale_2": g}


def edge_scales(tensors: dict[str, torch.Tensor]) -> None:
    """Set zero, subnormal and maximal E4M3 block scales in place (bits 0x00, 0x01, 0x07, 0x7E)."""
    bits = tensors["weight_scale"].view(torch.uint8)
    bits[1, 0] = 0x00
    bits[1, -1] = 0x01
    bits[-1, 0] = 0x07
    bits[-1, -1] = 0x7E


def every_code_and_scale(dtype: torch.dtype = torch.bfloat16
                         ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Weights holding every E2M1 code (each 16-element block is codes 0..15) under every
    finite E4M3 block scale (bits 0x00..0x7E and 0x80..0xFE, then 0x38 = 1.0 to fill), N = 16
    and K = 256, with a global scale of 2^-3; and the identity activations [256, 256] that
    make ``y[m, n] = W[n, m]``, a single exact product per output."""
    n, k = 16, 256
    codes = torch.arange(16, dtype=torch.uint8).repeat(n, k // 16)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    finite = [b for b in range(256) if b & 0x7F != 0x7F]
    bits = torch.tensor(finite + [0x38] * (n * k // 16 - len(finite)), dtype=torch.uint8)
    scales = bits.reshape(n, k // 16).view(torch.float8_e4m3fn)
    tensors = {"weight": packed, "weight_scale": scales,
               "weight_scale_2": torch.tensor(0.125, dtype=torch.float32)}
    return tensors, torch.eye(k, dtype=dtype)


def run_on(config: KernelConfig, x: torch.Tensor, tensors: dict[str, torch.Tensor],
           bias: torch.Tensor | None) -> torch.Tensor:
    """``x`` through ``config`` with the checkpoint ``tensors`` converted to the layout its
    kernel reads (``linear_triton.layout_tensors``)."""
    from kernelbay_quant_nvfp4.linear_triton import run_config

    weight, scales = layout_tensors(tensors["weight"], tensors["weight_scale"], layout_of(config))
    return run_config(config, x, weight, scales, tensors["weight_scale_2"].reshape(1), bias)


def strided_extreme_activations(m: int, k: int, gen: torch.Generator,
                                device: str = "cuda") -> torch.Tensor:
    """bf16 activations [m >= 4, k] whose rows have a stride (a slice of a wider tensor), with
    a zero row, a row of huge values every seventh element, and a row of subnormals."""
    wide = torch.randn(m, k + 64, generator=gen).bfloat16().to(device)
    x = wide[:, 32:32 + k]
    x[1] = 0.0
    x[2, ::7] = 1e30
    x[3] = torch.randn(k, generator=gen).bfloat16().to(device) * 1e-38
    return x


def cuda_weights(n: int, k: int, gen: torch.Generator
                 ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Random NVFP4 weights [n, k] on the GPU and their reference dequantization (float32)."""
    from kernelbay.formats import dequantize_nvfp4

    tensors = {name: t.cuda() for name, t in nvfp4_weights(n, k, gen).items()}
    return tensors, dequantize_nvfp4(tensors["weight"], tensors["weight_scale"],
                                     tensors["weight_scale_2"])


def check_programmatic_chain(monkeypatch: Any, run: Any, m: int) -> None:
    """Three chained 1024 x 1024 layers through ``run(x, words, codes, weight_scale_2)`` (the
    tiles layout) checked by ``kernelbay.testing.programmatic.check_programmatic_chain``."""
    from kernelbay.testing.programmatic import check_programmatic_chain as check_chain

    gen = torch.Generator().manual_seed(m)
    layers = []
    for _ in range(3):
        tensors, _ = cuda_weights(1024, 1024, gen)
        words, codes = layout_tensors(tensors["weight"], tensors["weight_scale"], "tiles")
        layers.append(functools.partial(_layer, run, words, codes, tensors["weight_scale_2"]))
    inputs = [torch.randn(m, 1024, generator=gen).bfloat16().cuda() for _ in range(4)]
    check_chain(monkeypatch, layers, inputs)


def _layer(run: Any, words: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
           x: torch.Tensor) -> torch.Tensor:
    return run(x, words, codes, scale)  # type: ignore[no-any-return]
