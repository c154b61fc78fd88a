"""Numerics and choice of the acme linear method."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from acme_kernels.upcast_linear import Fp32UpcastLinear
from kernelbay import BackendKind, LinearRequest, Policy, Registry, parse_device, select


@pytest.mark.parametrize("m", [1, 5, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_fp32_reference_rounded_once(m: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(m)
    method = Fp32UpcastLinear(LinearRequest(40, 24, activation_dtype=str(dtype)[6:], bias=True))
    layer = torch.nn.Module()
    method.create_weights(layer)
    layer.weight.data.copy_(torch.randn(24, 40, generator=gen))
    layer.bias.data.copy_(torch.randn(24, generator=gen))
    method.process_weights_after_loading(layer)
    x = torch.randn(m, 40, generator=gen).to(dtype)
    expected = F.linear(x.float(), layer.weight.float(), layer.bias.float()).to(dtype)
    assert torch.equal(method.apply(layer, x), expected)


def test_chosen_only_on_cpus_without_bf16() -> None:
    import importlib.metadata as metadata

    (ep,) = [e for e in metadata.entry_points(group="kernelbay.plugins") if e.name == "acme"]
    registry = Registry(Policy(plugins=frozenset({"acme"})))
    registry.load_entry_point(ep)
    request = LinearRequest(4096, 4096)
    plain = select(BackendKind.LINEAR, request, parse_device("cpu+avx2"), registry=registry)
    assert plain.name == "acme-fp32-upcast"
    bf16 = select(BackendKind.LINEAR, request, parse_device("cpu+avx512_bf16"), registry=registry)
    assert bf16.name == "torch-unquantized"
    (line,) = [t for t in bf16.trace if t.backend == "acme-fp32-upcast"]
    assert "avx512_bf16" in line.reason
