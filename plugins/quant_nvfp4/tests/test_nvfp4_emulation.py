"""``nvfp4-emulation`` against the ``kernelbay.formats`` reference, bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernelbay.device import parse_device
from kernelbay.formats import dequantize_nvfp4, nvfp4_global_scale, quantize_nvfp4
from kernelbay.requests import LayerRole, LinearRequest, QuantScheme
from kernelbay.testing import load_method
from kernelbay_quant_nvfp4.emulation import Nvfp4EmulationLinear
from kernelbay_quant_nvfp4.schemes import nvfp4_scheme
from kernelbay_quant_nvfp4.tp import shard_block_scales

W4A4 = nvfp4_scheme("modelopt", w4a4=True)
W4A16 = nvfp4_scheme("compressed-tensors", w4a4=False)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _layer(method: Nvfp4EmulationLinear, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """Create the method's parameters, load ``tensors`` into them, finish loading."""
    return load_method(method, tensors)


def _weights(n: int, k: int, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(n, k, generator=gen) * scale


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize(("n", "k"), [(48, 64), (8, 16), (40, 272)])
@pytest.mark.parametrize("bias", [False, True])
def test_weight_only_bit_exact_against_reference(dtype: str, n: int, k: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(n * 1000 + k + bias)
    packed, scales, g = quantize_nvfp4(_weights(n, k, gen))
    tensors = {"weight": packed, "weight_scale": scales, "weight_scale_2": g}
    if bias:
        tensors["bias"] = torch.randn(n, generator=gen).to(DTYPES[dtype])
    method = Nvfp4EmulationLinear(LinearRequest(k, n, W4A16, dtype, bias))
    layer = _layer(method, tensors)
    w = dequantize_nvfp4(packed, scales, g).to(DTYPES[dtype])
    for m in (1, 3, 17, 64):  # ragged M
        x = torch.randn(m, k, generator=gen).to(DTYPES[dtype])
        want = F.linear(x, w, tensors.get("bias"))
        got = method.apply(layer, x)
        assert got.dtype == DTYPES[dtype]
        assert torch.equal(got, want)
    # Leading batch dimensions, and zero activations give exactly the bias (or zeros).
    x3 = torch.randn(2, 5, k, generator=gen).to(DTYPES[dtype])
    assert torch.equal(method.apply(layer, x3), F.linear(x3, w, tensors.get("bias")))
    zeros = method.apply(layer, torch.zeros(4, k, dtype=DTYPES[dtype]))
    expect = tensors["bias"].expand(4, n) if bias else torch.zeros(4, n, dtype=DTYPES[dtype])
    assert torch.equal(zeros, expect)
    assert torch.equal(method.dequantized_weight(layer), w)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("bias", [False, True])
def test_w4a4_fake_quantizes_activations_with_input_scale(dtype: str, bias: bool) -> None:
    """W4A4: x goes through NVFP4 with the static input_scale as its global scale (block
    scales from the tokens), the matmul runs in float32 and the result is cast back."""
    n, k = 40, 96
    gen = torch.Generator().manual_seed(5 + bias)
    packed, scales, g = quantize_nvfp4(_weights(n, k, gen))
    x = (torch.randn(7, k, generator=gen) * torch.logspace(-3, 1, k)).to(DTYPES[dtype])
    x[0] = 0.0
    x[1, :16] = 1e4  # beyond 6 * 448 * input_scale: saturates, as a kernel would
    input_scale = nvfp4_global_scale(x[2:].float().abs().amax())
    tensors = {"weight": packed, "weight_scale": scales, "weight_scale_2": g,
               "input_scale": input_scale}
    if bias:
        tensors["bias"] = torch.randn(n, generator=gen).to(DTYPES[dtype])
    method = Nvfp4EmulationLinear(LinearRequest(k, n, W4A4, dtype, bias))
    layer = _layer(method, tensors)
    xq = dequantize_nvfp4(*quantize_nvfp4(x, input_scale))
    b = tensors["bias"].float() if bias else None
    want = F.linear(xq, dequantize_nvfp4(packed, scales, g), b).to(DTYPES[dtype])
    got = method.apply(layer, x)
    assert got.dtype == DTYPES[dtype] and torch.equal(got, want)
    # The activations really are quantized: the unquantized product differs.
    plain = F.linear(x.float(), dequantize_nvfp4(packed, scales, g), b).to(DTYPES[dtype])
    assert not torch.equal(got, plain)
    assert torch.isfinite(got).all()
    # MLA folds the weight into other math: the dense weight comes back exactly.
    assert torch.equal(method.dequantized_weight(layer),
                       dequantize_nvfp4(packed, scales, g).to(DTYPES[dtype]))


def test_zero_and_extreme_weights() -> None:
    gen = torch.Generator().manual_seed(7)
    n, k = 32, 64
    w = _weights(n, k, gen, 1e-3)
    w[:8] = 0.0  # all-zero rows and blocks
    w[8:12] *= 1e6  # a few huge rows: small blocks elsewhere lean on the global scale
    w[12, :16] = torch.tensor([6.0 * 448.0 * 100] + [0.0] * 15)
    packed, scales, g = quantize_nvfp4(w)
    method = Nvfp4EmulationLinear(LinearRequest(k, n, W4A16, "float32"))
    layer = _layer(method, {"weight": packed, "weight_scale": scales, "weight_scale_2": g})
    ref = dequantize_nvfp4(packed, scales, g)
    assert torch.equal(layer.dequantized_weight, ref)
    assert torch.all(ref[:8] == 0)
    x = torch.randn(9, k, generator=gen)
    assert torch.equal(method.apply(layer, x), F.linear(x, ref))
    assert torch.isfinite(method.apply(layer, x)).all()


def test_apply_before_loading_is_an_error() -> None:
    method = Nvfp4EmulationLinear(LinearRequest(16, 8, W4A4, "float32"))
    layer = torch.nn.Module()
    method.create_weights(layer)
    with pytest.raises(RuntimeError, match="process_weights_after_loading"):
        method.apply(layer, torch.zeros(1, 16))


def test_can_implement() -> None:
    cpu, gpu = parse_device("cpu"), parse_device("sm_90")
    ok = Nvfp4EmulationLinear.can_implement(LinearRequest(4096, 4096, W4A4), cpu)
    assert ok.accepted and "fake-quantized nvfp4-dynamic" in ok.describe()
    assert Nvfp4EmulationLinear.can_implement(LinearRequest(64, 8, W4A16, "float16"), gpu)
    fp8_act = QuantScheme("nvfp4", "e2m1", (1, 16), "float8_e4m3fn", True, "fp8-static")
    cases = {
        "K=4100 is not a multiple of the NVFP4 block 16": LinearRequest(4100, 64, W4A4),
        "handles NVFP4 weights only": LinearRequest(
            64, 64, QuantScheme("mxfp4", "e2m1", (1, 32), "e8m0", dialect="quark")),
        "needs activation dtype": LinearRequest(64, 64, W4A4, "int8"),
        "routed-expert MLP of 8 experts": LinearRequest(64, 64, W4A4, num_experts=8),
        "blocks of 1x16": LinearRequest(64, 64, QuantScheme("nvfp4", "e2m1", (1, 32), "e8m0")),
        "scheme has 'fp8-static'": LinearRequest(64, 64, fp8_act),
    }
    for reason, request in cases.items():
        verdict = Nvfp4EmulationLinear.can_implement(request, cpu)
        assert not verdict.accepted and reason in verdict.reason, verdict.reason
    # A routed-expert request is not this method's business (not a fallback to warn about).
    assert not Nvfp4EmulationLinear.can_implement(LinearRequest(64, 64, W4A4, num_experts=8),
                                                  cpu).applicable


def test_tensor_specs_under_tensor_parallel() -> None:
    col = Nvfp4EmulationLinear(LinearRequest(64, 96, W4A4, "bfloat16", True,
                                             LayerRole.ATTN_QKV, "column", 1, 2)).tensor_specs()
    assert (col["weight"].shape, col["weight"].shard_dim) == ((96, 32), 0)
    assert (col["weight_scale"].shape, col["weight_scale"].shard_dim) == ((96, 4), 0)
    assert (col["weight_scale_2"].shape, col["weight_scale_2"].shard_dim) == ((), None)
    assert col["input_scale"].shape == () and col["input_scale"].shard_dim is None
    assert col["bias"].shard_dim == 0
    row = Nvfp4EmulationLinear(LinearRequest(32, 64, W4A4, "bfloat16", True,
                                             LayerRole.ATTN_OUT, "row", 1, 2)).tensor_specs()
    assert (row["weight"].shape, row["weight"].shard_dim) == ((64, 16), 1)
    assert (row["weight_scale"].shape, row["weight_scale"].shard_dim) == ((64, 2), 1)
    assert row["bias"].shard_dim is None
    assert "input_scale" in row and "bias" not in Nvfp4EmulationLinear(
        LinearRequest(32, 64, W4A4)).tensor_specs()
    # Weight-only checkpoints carry no input_scale, so the method does not ask for one.
    assert "input_scale" not in Nvfp4EmulationLinear(LinearRequest(32, 64, W4A16)).tensor_specs()


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_sharded_ranks_match_the_whole_layer(tp: int) -> None:
    """Column shards concatenate to the whole output bit for bit; row shards each equal the
    reference on their K slice (the all-reduce then sums them)."""
    gen = torch.Generator().manual_seed(tp)
    n, k = 64, 128
    packed, scales, g = quantize_nvfp4(_weights(n, k, gen))
    x = torch.randn(5, k, generator=gen)
    whole = F.linear(x, dequantize_nvfp4(packed, scales, g))
    cols = []
    for r in range(tp):
        method = Nvfp4EmulationLinear(LinearRequest(k, n // tp, W4A16, "float32",
                                                    role=LayerRole.ATTN_QKV, parallel="column",
                                                    tp_rank=r, tp_size=tp))
        part = {"weight": packed.chunk(tp, 0)[r], "weight_scale_2": g,
                "weight_scale": shard_block_scales(scales, 0, r, tp, 1)}
        cols.append(method.apply(_layer(method, part), x))
    assert torch.equal(torch.cat(cols, dim=-1), whole)
    for r in range(tp):
        method = Nvfp4EmulationLinear(LinearRequest(k // tp, n, W4A16, "float32",
                                                    role=LayerRole.MLP_DOWN, parallel="row",
                                                    tp_rank=r, tp_size=tp))
        part = {"weight": packed.chunk(tp, 1)[r], "weight_scale_2": g,
                "weight_scale": shard_block_scales(scales, 1, r, tp, 16, size=k)}
        xr = x.chunk(tp, -1)[r]
        ref = F.linear(xr, dequantize_nvfp4(packed, scales, g).chunk(tp, 1)[r])
        assert torch.equal(method.apply(_layer(method, part), xr), ref)
