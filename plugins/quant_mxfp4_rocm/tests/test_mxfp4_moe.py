"""``mxfp4-moe-emulation`` against the reference: ``kernelbay.formats.mx`` for the numbers and
a per-token loop (or the core's ``TorchMoE`` on the dequantized weights) for the MoE."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernelbay.device import parse_device
from kernelbay.formats import dequantize_mx, quantize_mx
from kernelbay.layers.moe import MOE_EXPERTS_ROLE, TorchMoE, expert_tensor
from kernelbay.requests import LinearRequest, QuantScheme
from kernelbay.testing import load_method
from kernelbay_quant_mxfp4_rocm.emulation import Mxfp4EmulationLinear
from kernelbay_quant_mxfp4_rocm.moe import Mxfp4MoEEmulation

CPU = parse_device("cpu")
PROJ = ("gate_proj", "up_proj", "down_proj")
ELEM = {"mxfp4-dynamic": "e2m1", "mxfp8-dynamic": "e4m3"}


def mx(activation: str | None = None, mode: str = "even") -> QuantScheme:
    return QuantScheme("mxfp4", "e2m1", (1, 32), "e8m0", False, activation, "quark",
                       (("scale_mode", mode),))


def _request(scheme: QuantScheme, experts: int, hidden: int, inter: int,
             dtype: str = "bfloat16", **kw: object) -> LinearRequest:
    return LinearRequest(hidden, inter, scheme, dtype, False, MOE_EXPERTS_ROLE,
                         num_experts=experts, **kw)  # type: ignore[arg-type]


def _weights(experts: int, hidden: int, inter: int, seed: int
             ) -> dict[tuple[int, str], torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = {"gate_proj": (inter, hidden), "up_proj": (inter, hidden),
              "down_proj": (hidden, inter)}
    w = {(e, p): torch.randn(*shapes[p], generator=gen) * 0.1 for e in range(experts)
         for p in PROJ}
    w[(0, "gate_proj")][:2] = 0.0  # zero rows: the smallest scale
    return w


def _load(method: Mxfp4MoEEmulation, weights: dict[tuple[int, str], torch.Tensor]
          ) -> torch.nn.Module:
    tensors: dict[str, torch.Tensor] = {}
    for (e, p), w in weights.items():
        tensors[expert_tensor(e, p)], tensors[expert_tensor(e, p, "weight_scale")] = (
            quantize_mx(w, "e2m1", "even"))
    assert set(tensors) == set(method.tensor_specs())
    return load_method(method, tensors, exact_dtype=False)


def _routing(tokens: int, experts: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    return ids, torch.rand(tokens, k, generator=gen) + 0.1


@pytest.mark.parametrize(("activation", "rule"), [
    ("mxfp4-dynamic", "even"), ("mxfp4-dynamic", "floor"), ("mxfp4-dynamic", "rceil"),
    ("mxfp8-dynamic", "even")])
def test_mx_activations_match_a_per_token_reference(activation: str, rule: str) -> None:
    experts, hidden, inter, tokens = 4, 64, 96, 9
    weights = _weights(experts, hidden, inter, 1)
    method = Mxfp4MoEEmulation(_request(mx(activation, rule), experts, hidden, inter))
    layer = _load(method, weights)
    x = (torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(2))
         * torch.logspace(-2, 2, hidden)).bfloat16()
    x[4] = 0.0
    ids, topk = _routing(tokens, experts, 2, 3)
    got = method.apply_moe(layer, x, ids, topk)
    assert got.dtype == torch.bfloat16

    elem = ELEM[activation]

    def fq(v: torch.Tensor) -> torch.Tensor:
        return dequantize_mx(*quantize_mx(v, elem, rule), elem)  # type: ignore[arg-type]

    dq = {key: dequantize_mx(*quantize_mx(w, "e2m1", "even"), "e2m1")
          for key, w in weights.items()}
    want = torch.zeros(tokens, hidden, dtype=torch.float64)
    for t in range(tokens):
        for j in range(2):
            e = int(ids[t, j])
            xq = fq(x[t:t + 1])
            h = F.silu(xq @ dq[(e, "gate_proj")].T) * (xq @ dq[(e, "up_proj")].T)
            want[t] += float(topk[t, j]) * (fq(h) @ dq[(e, "down_proj")].T)[0].double()
    torch.testing.assert_close(got.double(), want.bfloat16().double(), rtol=1e-2, atol=1e-3)
    assert torch.all(got[4] == 0)
    plain = Mxfp4MoEEmulation(_request(mx(None), experts, hidden, inter))
    assert not torch.equal(plain.apply_moe(_load(plain, weights), x, ids, topk), got)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_weight_only_equals_torch_moe_on_the_dequantized_weights(dtype: str) -> None:
    experts, hidden, inter, tokens = 3, 32, 64, 13
    weights = _weights(experts, hidden, inter, 4)
    method = Mxfp4MoEEmulation(_request(mx(), experts, hidden, inter, dtype))
    layer = _load(method, weights)
    ref = TorchMoE(_request(QuantScheme("unquantized"), experts, hidden, inter, dtype))
    ref_layer = torch.nn.Module()
    ref.create_weights(ref_layer)
    for (e, p), w in weights.items():
        dense = dequantize_mx(*quantize_mx(w, "e2m1", "even"), "e2m1")
        getattr(ref_layer, expert_tensor(e, p)).data.copy_(dense.to(getattr(torch, dtype)))
    ref.process_weights_after_loading(ref_layer)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(5))
    x = x.to(getattr(torch, dtype))
    ids, topk = _routing(tokens, experts, 2, 6)
    assert torch.equal(method.apply_moe(layer, x, ids, topk),
                       ref.apply_moe(ref_layer, x, ids, topk))


def test_column_parallel_ranks_sum_to_the_whole() -> None:
    experts, hidden, inter, tokens, tp = 3, 32, 128, 5, 2
    weights = _weights(experts, hidden, inter, 7)
    whole = Mxfp4MoEEmulation(_request(mx("mxfp4-dynamic"), experts, hidden, inter, "float32"))
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(8))
    ids, topk = _routing(tokens, experts, 2, 9)
    want = whole.apply_moe(_load(whole, weights), x, ids, topk)
    total = torch.zeros_like(want)
    for rank in range(tp):
        method = Mxfp4MoEEmulation(_request(mx("mxfp4-dynamic"), experts, hidden, inter // tp,
                                            "float32", parallel="column", tp_rank=rank,
                                            tp_size=tp))
        total += method.apply_moe(_load(method, weights), x, ids, topk)
    torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-5)


def test_can_implement() -> None:
    ok = Mxfp4MoEEmulation.can_implement(_request(mx("mxfp4-dynamic"), 8, 256, 128), CPU)
    assert ok.accepted and "mxfp4-dynamic (scale rule even)" in ok.describe()
    home = Mxfp4MoEEmulation.can_implement(_request(mx(), 8, 256, 128), parse_device("gfx950"))
    assert "the Triton methods are preferred where they accept" in home.describe()
    dense = Mxfp4MoEEmulation.can_implement(LinearRequest(256, 128, mx()), CPU)
    assert not dense.applicable and "dense" in dense.reason
    nvfp4 = QuantScheme("nvfp4", "e2m1", (1, 16), "float8_e4m3fn", True, None, "modelopt")
    assert not Mxfp4MoEEmulation.can_implement(_request(nvfp4, 8, 256, 128), CPU).applicable
    cases = {
        "intermediate size 48": _request(mx(), 8, 256, 48),
        "hidden size K=80": _request(mx(), 8, 80, 128),
        "scale_mode 'ceil'": _request(mx("mxfp4-dynamic", "ceil"), 8, 256, 128),
        "bias=True": LinearRequest(256, 128, mx(), "bfloat16", True, MOE_EXPERTS_ROLE,
                                   num_experts=8),
    }
    for reason, request in cases.items():
        verdict = Mxfp4MoEEmulation.can_implement(request, CPU)
        assert not verdict.accepted and verdict.applicable and reason in verdict.reason, (
            verdict.reason)
    assert not Mxfp4EmulationLinear.can_implement(_request(mx(), 8, 256, 128), CPU).applicable


def test_apply_before_loading_is_an_error() -> None:
    method = Mxfp4MoEEmulation(_request(mx(), 2, 64, 32))
    layer = torch.nn.Module()
    method.create_weights(layer)
    assert len(method.tensor_specs()) == 2 * 3 * 2
    with pytest.raises(RuntimeError, match="process_weights_after_loading"):
        method.apply_moe(layer, torch.zeros(1, 64), torch.zeros(1, 1, dtype=torch.long),
                         torch.ones(1, 1))
