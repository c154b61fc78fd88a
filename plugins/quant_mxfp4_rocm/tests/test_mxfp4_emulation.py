"""``mxfp4-emulation`` against the ``kernelbay.formats.mx`` reference math, bit for bit."""

from __future__ import annotations

from typing import get_args

import pytest
import torch
import torch.nn.functional as F
from kernelbay.device import parse_device
from kernelbay.formats import ScaleRule, dequantize_mx, quantize_mx
from kernelbay.requests import LayerRole, LinearRequest, QuantScheme
from kernelbay_quant_mxfp4_rocm.devices import home_note, rocm_home
from kernelbay_quant_mxfp4_rocm.emulation import SCALE_RULES, Mxfp4EmulationLinear

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
ELEM = {"mxfp4-dynamic": "e2m1", "mxfp8-dynamic": "e4m3"}


def mx(activation: str | None = None, mode: str | None = "even") -> QuantScheme:
    options = () if mode is None else (("scale_mode", mode),)
    return QuantScheme("mxfp4", "e2m1", (1, 32), "e8m0", False, activation, "quark", options)


def _layer(method: Mxfp4EmulationLinear, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    layer = torch.nn.Module()
    method.create_weights(layer)
    specs = method.tensor_specs()
    assert set(tensors) == set(specs)
    for name, value in tensors.items():
        assert tuple(value.shape) == specs[name].shape
        getattr(layer, name).data.copy_(value)
    method.process_weights_after_loading(layer)
    return layer


def _quantized(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    w[0] = 0.0  # a zero row: every block takes the smallest scale
    return quantize_mx(w, "e2m1", "even")


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize(("n", "k"), [(48, 64), (8, 32), (24, 160)])
def test_weight_only_bit_exact(dtype: str, n: int, k: int) -> None:
    packed, scales = _quantized(n, k, n + k)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(DTYPES[dtype])
    method = Mxfp4EmulationLinear(LinearRequest(k, n, mx(), dtype, True))
    layer = _layer(method, {"weight": packed, "weight_scale": scales, "bias": bias})
    w = dequantize_mx(packed, scales, "e2m1").to(DTYPES[dtype])
    gen = torch.Generator().manual_seed(k)
    for m in (1, 3, 17):
        x = torch.randn(m, k, generator=gen).to(DTYPES[dtype])
        assert torch.equal(method.apply(layer, x), F.linear(x, w, bias))
    assert torch.equal(method.apply(layer, torch.zeros(2, k, dtype=DTYPES[dtype])),
                       bias.expand(2, n))
    assert torch.equal(method.dequantized_weight(layer), w)


@pytest.mark.parametrize("activation", sorted(ELEM))
@pytest.mark.parametrize("rule", SCALE_RULES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_mx_activations_bit_exact(activation: str, rule: str, dtype: str) -> None:
    n, k = 40, 96
    packed, scales = _quantized(n, k, 5)
    method = Mxfp4EmulationLinear(LinearRequest(k, n, mx(activation, rule), dtype))
    layer = _layer(method, {"weight": packed, "weight_scale": scales})
    w = dequantize_mx(packed, scales, "e2m1")
    gen = torch.Generator().manual_seed(len(rule))
    x = torch.randn(2, 7, k, generator=gen) * torch.logspace(-3, 3, k)  # wide block ranges
    x[0, 0] = 0.0
    x[1, 1, :32] = 1e30  # an extreme block
    x = x.to(DTYPES[dtype])
    elem = ELEM[activation]
    data, s = quantize_mx(x, elem, rule)  # type: ignore[arg-type]
    want = F.linear(dequantize_mx(data, s, elem), w).to(DTYPES[dtype])  # type: ignore[arg-type]
    got = method.apply(layer, x)
    assert got.dtype == DTYPES[dtype] and torch.equal(got, want)
    # MLA folds the weight into other math: the dense weight comes back exactly.
    assert torch.equal(method.dequantized_weight(layer), w.to(DTYPES[dtype]))
    assert torch.all(got[0, 0] == 0)
    # The scale rule matters: another rule gives other activations somewhere.
    other = "floor" if rule != "floor" else "rceil"
    data2, s2 = quantize_mx(x, elem, other)  # type: ignore[arg-type]
    assert not torch.equal(dequantize_mx(data2, s2, elem), dequantize_mx(data, s, elem))  # type: ignore[arg-type]


def test_missing_scale_mode_means_even() -> None:
    n, k = 16, 64
    packed, scales = _quantized(n, k, 9)
    method = Mxfp4EmulationLinear(LinearRequest(k, n, mx("mxfp4-dynamic", None), "float32"))
    layer = _layer(method, {"weight": packed, "weight_scale": scales})
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(2)) * 5
    xq = dequantize_mx(*quantize_mx(x, "e2m1", "even"), "e2m1")
    assert torch.equal(method.apply(layer, x),
                       F.linear(xq, dequantize_mx(packed, scales, "e2m1")))


def test_scale_rules_are_the_references() -> None:
    assert set(SCALE_RULES) == set(get_args(ScaleRule))


def test_can_implement() -> None:
    cpu = parse_device("cpu")
    assert Mxfp4EmulationLinear.can_implement(LinearRequest(4096, 4096, mx()), cpu)
    w4a4 = Mxfp4EmulationLinear.can_implement(LinearRequest(64, 64, mx("mxfp8-dynamic")), cpu)
    assert w4a4.accepted and "mxfp8-dynamic (scale rule even)" in w4a4.describe()
    # Weight-only layers never recompute scales, so Quark's "ceil" is fine there.
    assert Mxfp4EmulationLinear.can_implement(LinearRequest(64, 64, mx(None, "ceil")), cpu)
    nvfp4 = QuantScheme("nvfp4", "e2m1", (1, 16), "float8_e4m3fn", True, None, "modelopt")
    cases = {
        "K=4100 is not a multiple of the MX block 32": LinearRequest(4100, 64, mx()),
        "handles OCP MXFP4 weights only": LinearRequest(64, 64, nvfp4),
        "scale_mode 'ceil'": LinearRequest(64, 64, mx("mxfp4-dynamic", "ceil")),
        "scheme has 'fp8-static'": LinearRequest(64, 64, mx("fp8-static")),
        "routed-expert MLP of 4 experts": LinearRequest(64, 64, mx(), num_experts=4),
        "request has 'int8'": LinearRequest(64, 64, mx(), "int8"),
    }
    for reason, request in cases.items():
        verdict = Mxfp4EmulationLinear.can_implement(request, cpu)
        assert not verdict.accepted and reason in verdict.reason, verdict.reason
    # A routed-expert request is not this method's business (not a fallback to warn about).
    assert not Mxfp4EmulationLinear.can_implement(LinearRequest(64, 64, mx(), num_experts=4),
                                                  cpu).applicable


def test_tensor_specs_under_tensor_parallel() -> None:
    col = Mxfp4EmulationLinear(LinearRequest(128, 32, mx(), "bfloat16", True,
                                             LayerRole.MLP_GATE_UP, "column", 0, 4))
    specs = col.tensor_specs()
    assert (specs["weight"].shape, specs["weight"].shard_dim) == ((32, 64), 0)
    assert (specs["weight_scale"].shape, specs["weight_scale"].shard_dim) == ((32, 4), 0)
    assert specs["bias"].shard_dim == 0
    row = Mxfp4EmulationLinear(LinearRequest(64, 128, mx(), "bfloat16", True,
                                             LayerRole.MLP_DOWN, "row", 1, 2)).tensor_specs()
    assert (row["weight_scale"].shape, row["weight_scale"].shard_dim) == ((128, 2), 1)
    assert row["bias"].shard_dim is None


def test_row_shards_match_the_reference() -> None:
    n, k, tp = 32, 128, 2
    packed, scales = _quantized(n, k, 11)
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(3))
    w = dequantize_mx(packed, scales, "e2m1")
    for r in range(tp):
        method = Mxfp4EmulationLinear(LinearRequest(k // tp, n, mx(), "float32", True,
                                                    LayerRole.MLP_DOWN, "row", r, tp))
        bias = torch.ones(n)
        layer = _layer(method, {"weight": packed.chunk(tp, 1)[r],
                                "weight_scale": scales.chunk(tp, 1)[r], "bias": bias})
        xr = x.chunk(tp, -1)[r]
        # Only rank 0 adds the bias; the all-reduce sums the partial products.
        want = F.linear(xr, w.chunk(tp, 1)[r], bias if r == 0 else None)
        assert torch.equal(method.apply(layer, xr), want)


def test_device_wording() -> None:
    assert rocm_home(parse_device("gfx950")).accepted
    assert rocm_home(parse_device("gfx942")).accepted
    cuda = rocm_home(parse_device("sm_90"))
    assert not cuda.accepted and cuda.reason == "runs on ROCm gfx942/gfx950, device is cuda sm_90"
    old = rocm_home(parse_device("gfx90a"))
    assert old.reason == "needs a ROCm architecture in ['gfx942', 'gfx950'], device is 'gfx90a'"
    assert "native MX" in home_note(parse_device("gfx950"))
    assert "no native MX" in home_note(parse_device("gfx942"))
    assert home_note(parse_device("cpu")) == ""
    verdict = Mxfp4EmulationLinear.can_implement(LinearRequest(64, 64, mx()),
                                                 parse_device("gfx950"))
    assert "the Triton methods are preferred where they accept" in verdict.describe()
