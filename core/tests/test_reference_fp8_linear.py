"""The core's FP8 reference linear: loads canonical FP8 tensors and matches the format reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernelbay import (
    BackendKind,
    LinearRequest,
    Policy,
    QuantScheme,
    Registry,
    parse_device,
    select,
)
from kernelbay.formats.fp8 import (
    dequantize_fp8_per_block,
    quantize_fp8_per_block,
    quantize_fp8_per_tensor,
)
from kernelbay.layers.torch_fp8_linear import TorchFp8DequantLinear
from kernelbay.testing import load_method

PER_TENSOR = QuantScheme("fp8", "float8_e4m3fn", None, "float32", dialect="modelopt")


def block_scheme(block: tuple[int, int]) -> QuantScheme:
    return QuantScheme("fp8-block", "float8_e4m3fn", block, "float32", dialect="hf-fp8")


def _load(method: TorchFp8DequantLinear, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    return load_method(method, tensors)


@pytest.mark.parametrize("n, k, block", [(256, 384, (128, 128)), (200, 300, (128, 128)),
                                         (33, 65, (16, 32)), (7, 5, (1, 128))])
@pytest.mark.parametrize("m", [1, 9])
def test_per_block_matches_reference_dequant(n: int, k: int, block: tuple[int, int],
                                             m: int) -> None:
    gen = torch.Generator().manual_seed(n * k + m)
    w = torch.randn(n, k, generator=gen) * torch.logspace(-3, 2, k)  # wide dynamic range
    w[0] = 0.0                                                       # a zero row
    q, scales = quantize_fp8_per_block(w, block)
    method = TorchFp8DequantLinear(LinearRequest(k, n, block_scheme(block), "float32",
                                                 bias=True))
    bias = torch.randn(n, generator=gen)
    layer = _load(method, {"weight": q, "weight_scale": scales, "bias": bias})
    x = torch.randn(m, k, generator=gen)
    expected = F.linear(x, dequantize_fp8_per_block(q, scales, block), bias)
    assert torch.equal(method.apply(layer, x), expected)
    # And the quantization itself is faithful: E4M3 has 3 mantissa bits (rel. error <= 2^-4).
    dense = dequantize_fp8_per_block(q, scales, block)
    normal = w.abs() > scales.repeat_interleave(block[0], 0)[:n].repeat_interleave(
        block[1], 1)[:, :k] * 2.0 ** -6
    assert ((dense - w).abs() <= w.abs() * 2.0 ** -4)[normal].all()


def test_per_tensor_with_bf16_activations() -> None:
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(64, 96, generator=gen)
    w[5, 7] = 448.0 * 3  # the tensor maximum sets the scale
    q, scale = quantize_fp8_per_tensor(w)
    method = TorchFp8DequantLinear(LinearRequest(96, 64, PER_TENSOR, "bfloat16"))
    layer = _load(method, {"weight": q, "weight_scale": scale})
    x = torch.randn(4, 96, generator=gen).bfloat16()
    expected = F.linear(x, (q.float() * scale).bfloat16())
    assert torch.equal(method.apply(layer, x), expected)


def test_tp_shards_scales_with_their_weight() -> None:
    req = LinearRequest(512, 256, block_scheme((128, 128)), parallel="row", tp_rank=1,
                        tp_size=2)
    specs = TorchFp8DequantLinear(req).tensor_specs()
    assert specs["weight"].shard_dim == 1 and specs["weight_scale"].shard_dim == 1
    assert specs["weight_scale"].shape == (2, 4)
    per_tensor = TorchFp8DequantLinear(LinearRequest(512, 256, PER_TENSOR)).tensor_specs()
    assert per_tensor["weight_scale"].shape == () and per_tensor["weight_scale"].shard_dim is None


def test_selected_for_fp8_schemes_only() -> None:
    registry = Registry(Policy(plugins=frozenset()))
    cpu = parse_device("cpu")
    chosen = select(BackendKind.LINEAR, LinearRequest(128, 128, PER_TENSOR), cpu,
                    registry=registry)
    assert chosen.name == "torch-fp8-dequant"
    verdict = TorchFp8DequantLinear.can_implement(
        LinearRequest(128, 128, QuantScheme("nvfp4")), cpu)
    assert not verdict and "'nvfp4'" in verdict.reason
