"""``nvfp4-moe-emulation`` against the reference: ``kernelbay.formats`` for the numbers and a
per-token float64 loop (or the core's ``TorchMoE`` on the dequantized weights) for the MoE."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernelbay.device import parse_device
from kernelbay.formats import dequantize_nvfp4, quantize_nvfp4
from kernelbay.layers.moe import MOE_EXPERTS_ROLE, TorchMoE, expert_tensor
from kernelbay.requests import LinearRequest, QuantScheme
from kernelbay.testing import load_method
from kernelbay_quant_nvfp4.emulation import Nvfp4EmulationLinear
from kernelbay_quant_nvfp4.moe import Nvfp4MoEEmulation
from kernelbay_quant_nvfp4.schemes import nvfp4_scheme

W4A4 = nvfp4_scheme("modelopt", w4a4=True)
W4A16 = nvfp4_scheme("modelopt", w4a4=False)
CPU = parse_device("cpu")
PROJ = ("gate_proj", "up_proj", "down_proj")


def _request(scheme: QuantScheme, experts: int, hidden: int, inter: int,
             dtype: str = "bfloat16", **kw: object) -> LinearRequest:
    return LinearRequest(hidden, inter, scheme, dtype, False, MOE_EXPERTS_ROLE,
                         num_experts=experts, **kw)  # type: ignore[arg-type]


def _experts(experts: int, hidden: int, inter: int, seed: int
             ) -> dict[tuple[int, str], torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = {"gate_proj": (inter, hidden), "up_proj": (inter, hidden),
              "down_proj": (hidden, inter)}
    w = {(e, p): torch.randn(*shapes[p], generator=gen) * 0.1 for e in range(experts)
         for p in PROJ}
    w[(0, "down_proj")][:3] = 0.0  # zero rows
    return w


def _load(method: Nvfp4MoEEmulation, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    assert set(method.tensor_specs()) == set(tensors)
    return load_method(method, tensors, exact_dtype=False)


def _quantized(weights: dict[tuple[int, str], torch.Tensor], w4a4: bool,
               input_scales: dict[tuple[int, str], float]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for (e, p), w in weights.items():
        packed, scales, g = quantize_nvfp4(w)
        out[expert_tensor(e, p)] = packed
        out[expert_tensor(e, p, "weight_scale")] = scales
        out[expert_tensor(e, p, "weight_scale_2")] = g
        if w4a4:
            out[expert_tensor(e, p, "input_scale")] = torch.tensor(input_scales[(e, p)])
    return out


def _routing(tokens: int, experts: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    return ids, torch.rand(tokens, k, generator=gen) + 0.1


def test_w4a4_matches_a_per_token_reference() -> None:
    experts, hidden, inter, tokens = 4, 64, 48, 11
    weights = _experts(experts, hidden, inter, 1)
    gen = torch.Generator().manual_seed(2)
    # Different gate and up input scales on one expert: both paths are exercised.
    scales = {(e, p): 0.0015 + 0.0005 * e for e in range(experts) for p in PROJ}
    scales[(2, "up_proj")] = 0.004
    method = Nvfp4MoEEmulation(_request(W4A4, experts, hidden, inter))
    layer = _load(method, _quantized(weights, True, scales))
    x = (torch.randn(tokens, hidden, generator=gen) * 2).bfloat16()
    x[3] = 0.0
    ids, topk = _routing(tokens, experts, 2, 3)
    got = method.apply_moe(layer, x, ids, topk)
    assert got.dtype == torch.bfloat16 and got.shape == (tokens, hidden)

    def fq(v: torch.Tensor, s: float) -> torch.Tensor:
        return dequantize_nvfp4(*quantize_nvfp4(v, torch.tensor(s)))

    dq = {key: dequantize_nvfp4(*quantize_nvfp4(w)) for key, w in weights.items()}
    want = torch.zeros(tokens, hidden, dtype=torch.float64)
    for t in range(tokens):
        for j in range(2):
            e = int(ids[t, j])
            g = fq(x[t:t + 1], scales[(e, "gate_proj")]) @ dq[(e, "gate_proj")].T
            u = fq(x[t:t + 1], scales[(e, "up_proj")]) @ dq[(e, "up_proj")].T
            h = F.silu(g) * u
            y = fq(h, scales[(e, "down_proj")]) @ dq[(e, "down_proj")].T
            want[t] += float(topk[t, j]) * y[0].double()
    torch.testing.assert_close(got.double(), want.bfloat16().double(), rtol=1e-2, atol=1e-3)
    assert torch.all(got[3] == 0)
    # The activations really are quantized: the weight-only result differs.
    plain = Nvfp4MoEEmulation(_request(W4A16, experts, hidden, inter))
    plain_layer = _load(plain, _quantized(weights, False, scales))
    assert not torch.equal(plain.apply_moe(plain_layer, x, ids, topk), got)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_weight_only_equals_torch_moe_on_the_dequantized_weights(dtype: str) -> None:
    experts, hidden, inter, tokens = 5, 32, 32, 17
    weights = _experts(experts, hidden, inter, 4)
    method = Nvfp4MoEEmulation(_request(W4A16, experts, hidden, inter, dtype))
    layer = _load(method, _quantized(weights, False, {}))
    ref = TorchMoE(_request(QuantScheme("unquantized"), experts, hidden, inter, dtype))
    ref_layer = torch.nn.Module()
    ref.create_weights(ref_layer)
    for (e, p), w in weights.items():
        dense = dequantize_nvfp4(*quantize_nvfp4(w)).to(getattr(torch, dtype))
        getattr(ref_layer, expert_tensor(e, p)).data.copy_(dense)
    ref.process_weights_after_loading(ref_layer)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(5))
    x = x.to(getattr(torch, dtype))
    ids, topk = _routing(tokens, experts, 3, 6)
    assert torch.equal(method.apply_moe(layer, x, ids, topk), ref.apply_moe(ref_layer, x, ids,
                                                                              topk))


def test_column_parallel_ranks_sum_to_the_whole() -> None:
    experts, hidden, inter, tokens, tp = 3, 32, 64, 6, 2
    weights = _experts(experts, hidden, inter, 7)
    scales = {(e, p): 0.002 for e in range(experts) for p in PROJ}
    whole = Nvfp4MoEEmulation(_request(W4A4, experts, hidden, inter, "float32"))
    full = _quantized(weights, True, scales)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(8))
    ids, topk = _routing(tokens, experts, 2, 9)
    want = whole.apply_moe(_load(whole, full), x, ids, topk)
    total = torch.zeros_like(want)
    for rank in range(tp):
        method = Nvfp4MoEEmulation(_request(W4A4, experts, hidden, inter // tp, "float32",
                                            parallel="column", tp_rank=rank, tp_size=tp))
        part = {}
        for name, spec in method.tensor_specs().items():
            value = full[name]
            if spec.shard_dim is not None:
                value = value.chunk(tp, spec.shard_dim)[rank]
            part[name] = value
        total += method.apply_moe(_load(method, part), x, ids, topk)
    torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-5)


def test_can_implement() -> None:
    ok = Nvfp4MoEEmulation.can_implement(_request(W4A4, 8, 256, 128), CPU)
    assert ok.accepted and "fake-quantized nvfp4-dynamic" in ok.describe()
    assert Nvfp4MoEEmulation.can_implement(_request(W4A16, 8, 256, 128, "float16"), CPU)
    dense = Nvfp4MoEEmulation.can_implement(LinearRequest(256, 128, W4A4), CPU)
    assert not dense.accepted and not dense.applicable and "dense" in dense.reason
    mx = QuantScheme("mxfp4", "e2m1", (1, 32), "e8m0", dialect="quark")
    other = Nvfp4MoEEmulation.can_implement(_request(mx, 8, 256, 128), CPU)
    assert not other.applicable and "NVFP4 experts only" in other.reason
    cases = {
        "intermediate size 40": _request(W4A4, 8, 256, 40),
        "hidden size K=72": _request(W4A4, 8, 72, 128),
        "bias=True": LinearRequest(256, 128, W4A4, "bfloat16", True, MOE_EXPERTS_ROLE,
                                   num_experts=8),
        "request has 'int8'": _request(W4A4, 8, 256, 128, "int8"),
    }
    for reason, request in cases.items():
        verdict = Nvfp4MoEEmulation.can_implement(request, CPU)
        assert not verdict.accepted and verdict.applicable and reason in verdict.reason, (
            verdict.reason)
    # The dense method leaves MoE requests alone, as not applicable.
    verdict = Nvfp4EmulationLinear.can_implement(_request(W4A4, 8, 256, 128), CPU)
    assert not verdict.applicable


def test_tensor_specs_and_loading_order() -> None:
    method = Nvfp4MoEEmulation(_request(W4A4, 2, 64, 32, parallel="column", tp_rank=0,
                                        tp_size=2))
    specs = method.tensor_specs()
    assert len(specs) == 2 * 3 * 4
    up = specs["experts.1.up_proj.weight"]
    assert (up.shape, up.dtype, up.shard_dim) == ((32, 32), "uint8", 0)
    down = specs["experts.1.down_proj.weight_scale"]
    assert (down.shape, down.dtype, down.shard_dim) == ((64, 2), "float8_e4m3fn", 1)
    assert specs["experts.0.down_proj.input_scale"].shard_dim is None
    assert "experts.0.gate_proj.input_scale" not in Nvfp4MoEEmulation(
        _request(W4A16, 2, 64, 32)).tensor_specs()
    layer = torch.nn.Module()
    method.create_weights(layer)
    with pytest.raises(RuntimeError, match="process_weights_after_loading"):
        method.apply_moe(layer, torch.zeros(1, 64), torch.zeros(1, 1, dtype=torch.long),
                         torch.ones(1, 1))
