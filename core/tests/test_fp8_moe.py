"""The core's FP8 routed-expert reference (torch-fp8-moe) against a float64 per-token loop on
weights dequantized by ``kernelbay.formats.fp8``: what it accepts, its tensors, its math on
random experts and routing (zero tokens, zero routing weights, an all-zero expert, codes at
+-448), ragged blocks, and tensor parallel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernelbay import BackendKind, LinearRequest, Policy, QuantScheme, Registry, parse_device
from kernelbay import select as select_backend
from kernelbay.formats.fp8 import (
    dequantize_fp8_per_block,
    dequantize_fp8_per_tensor,
    quantize_fp8_per_block,
    quantize_fp8_per_tensor,
)
from kernelbay.layers.moe import MOE_EXPERTS_ROLE, TorchFp8MoE, TorchMoE, expert_tensor
from kernelbay.testing import load_method
from torch import nn

CPU = parse_device("cpu")
CORE_ONLY = Registry(Policy(plugins=frozenset()))
PROJ_SHAPES = {"gate_proj": lambda h, i: (i, h), "up_proj": lambda h, i: (i, h),
               "down_proj": lambda h, i: (h, i)}


def fp8(block: tuple[int, int] | None) -> QuantScheme:
    if block is None:
        return QuantScheme("fp8", "float8_e4m3fn", None, "float32")
    return QuantScheme("fp8-block", "float8_e4m3fn", block, "float32", dialect="hf-fp8")


def moe_request(scheme: QuantScheme, hidden: int, inter: int, experts: int,
                dtype: str = "float32", **kw: object) -> LinearRequest:
    fields: dict[str, object] = dict(in_features=hidden, out_features=inter, scheme=scheme,
                                     activation_dtype=dtype, role=MOE_EXPERTS_ROLE,
                                     num_experts=experts)
    fields.update(kw)
    return LinearRequest(**fields)  # type: ignore[arg-type]


def quantized_experts(experts: int, hidden: int, inter: int, block: tuple[int, int] | None,
                      gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Canonical tensors of random experts quantized by the reference: expert 0 all zeros,
    expert 1 with a few huge weights (so its scales are large and codes reach +-448)."""
    tensors: dict[str, torch.Tensor] = {}
    for e in range(experts):
        for proj, shape_of in PROJ_SHAPES.items():
            dense = torch.randn(shape_of(hidden, inter), generator=gen) * 0.2
            if e == 0:
                dense.zero_()
            elif e == 1:
                dense[::7, ::5] *= 3e3
            q, s = (quantize_fp8_per_tensor(dense) if block is None
                    else quantize_fp8_per_block(dense, block))
            tensors[expert_tensor(e, proj)] = q
            tensors[expert_tensor(e, proj, "weight_scale")] = s
    return tensors


def dequantized(tensors: dict[str, torch.Tensor], block: tuple[int, int] | None,
                e: int, proj: str) -> torch.Tensor:
    q = tensors[expert_tensor(e, proj)]
    s = tensors[expert_tensor(e, proj, "weight_scale")]
    w = dequantize_fp8_per_tensor(q, s) if block is None else dequantize_fp8_per_block(q, s,
                                                                                         block)
    return w.double()


def plain_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              tensors: dict[str, torch.Tensor], block: tuple[int, int] | None) -> torch.Tensor:
    """Per token and slot, in float64: SiLU(x Wg^T) * (x Wu^T), then Wd, times the weight."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    xd = x.double()
    for row in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(ids[row, slot])
            h = (F.silu(xd[row] @ dequantized(tensors, block, e, "gate_proj").T)
                 * (xd[row] @ dequantized(tensors, block, e, "up_proj").T))
            out[row] += float(weights[row, slot]) * (h @ dequantized(tensors, block, e,
                                                                     "down_proj").T)
    return out


def load_layer(method: TorchMoE, tensors: dict[str, torch.Tensor]) -> nn.Module:
    """What the loader does: create, copy each present tensor (this rank's shard), finish."""
    return load_method(method, tensors, exact_dtype=False)


def routing(tokens: int, experts: int, k: int, gen: torch.Generator
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k ids over all experts but the last (never chosen); some weights exactly zero."""
    ids = torch.stack([torch.randperm(experts - 1, generator=gen)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=gen) * 2
    weights[::3, 0] = 0.0
    return ids, weights


def test_accepts_fp8_moe_requests_only() -> None:
    for block in (None, (128, 128), (32, 64)):
        assert TorchFp8MoE.can_implement(moe_request(fp8(block), 256, 128, 8), CPU).accepted
    dense = TorchFp8MoE.can_implement(LinearRequest(256, 128, fp8((128, 128))), CPU)
    assert not dense.accepted and not dense.applicable
    assert "routed-expert MLPs (num_experts set) only" in dense.reason
    other = TorchFp8MoE.can_implement(moe_request(QuantScheme("unquantized"), 256, 128, 8), CPU)
    assert not other.accepted and not other.applicable and "unquantized" in other.reason
    biased = TorchFp8MoE.can_implement(moe_request(fp8(None), 256, 128, 8, bias=True), CPU)
    assert not biased.accepted and biased.applicable
    assert "request 'moe_experts' has bias=True" in biased.reason
    half = TorchFp8MoE.can_implement(moe_request(fp8(None), 256, 128, 8, "int8"), CPU)
    assert "needs activation dtype in ('float32', 'bfloat16', 'float16'), request has 'int8'" \
        in half.reason
    split = TorchFp8MoE.can_implement(
        moe_request(fp8((128, 128)), 256, 96, 8, parallel="column", tp_rank=0, tp_size=2), CPU)
    assert not split.accepted and split.applicable
    assert "whole scale blocks (128, 128), request has 96" in split.reason
    # The unquantized reference leaves FP8 experts to this one.
    assert not TorchMoE.can_implement(moe_request(fp8(None), 256, 128, 8), CPU).applicable


def test_selection_routes_fp8_experts_and_dense_layers() -> None:
    moe = select_backend(BackendKind.LINEAR, moe_request(fp8((128, 128)), 256, 128, 8), CPU,
                         registry=CORE_ONLY)
    assert moe.name == "torch-fp8-moe"
    dense = select_backend(BackendKind.LINEAR, LinearRequest(256, 128, fp8((128, 128))), CPU,
                           registry=CORE_ONLY)
    assert dense.name == "torch-fp8-dequant"
    plain = select_backend(BackendKind.LINEAR, moe_request(QuantScheme("unquantized"), 256,
                                                           128, 8), CPU, registry=CORE_ONLY)
    assert plain.name == "torch-moe"


def test_tensor_specs() -> None:
    specs = TorchFp8MoE(moe_request(fp8((32, 64)), 96, 48, 3)).tensor_specs()
    assert len(specs) == 3 * 3 * 3
    assert specs[expert_tensor(2, "gate_proj")].shape == (48, 96)
    assert specs[expert_tensor(2, "gate_proj")].dtype == "float8_e4m3fn"
    assert specs[expert_tensor(2, "gate_proj", "weight_scale")].shape == (2, 2)
    assert specs[expert_tensor(2, "down_proj", "weight_scale")].shape == (3, 1)
    assert specs[expert_tensor(2, "down_proj", "weight_scale")].dtype == "float32"
    optional = specs[expert_tensor(0, "up_proj", "input_scale")]
    assert optional.shape == () and not optional.required
    per_tensor = TorchFp8MoE(moe_request(fp8(None), 96, 48, 3)).tensor_specs()
    assert per_tensor[expert_tensor(1, "down_proj", "weight_scale")].shape == ()


@pytest.mark.parametrize("block, hidden, inter", [
    (None, 64, 32),
    ((128, 128), 256, 128),
    ((128, 128), 96, 80),      # one partial tile in both directions
    ((32, 64), 96, 48),        # ragged edge tiles in N and K
    ((1, 32), 64, 32),         # per-row scales
])
def test_matches_the_dense_reference(block: tuple[int, int] | None, hidden: int,
                                     inter: int) -> None:
    gen = torch.Generator().manual_seed(hidden * 7 + inter)
    experts, k, tokens = 6, 2, 17
    tensors = quantized_experts(experts, hidden, inter, block, gen)
    big = tensors[expert_tensor(1, "gate_proj")].float().abs()
    assert (big == 448).any()  # codes at the end of the range are exercised
    method = TorchFp8MoE(moe_request(fp8(block), hidden, inter, experts))
    layer = load_layer(method, tensors)
    assert tuple(layer.w13.shape) == (experts, 2 * inter, hidden)
    assert tuple(layer.w2.shape) == (experts, hidden, inter)
    assert not any(n.startswith("experts.") for n, _ in layer.named_parameters())
    x = torch.randn(tokens, hidden, generator=gen)
    x[4] = 0.0
    ids, weights = routing(tokens, experts, k, gen)
    ids[0] = torch.tensor([0, 1])  # the all-zero expert and the huge one
    out = method.apply_moe(layer, x, ids, weights)
    assert out.dtype == torch.float32 and out.shape == x.shape
    ref = plain_moe(x, ids, weights, tensors, block)
    scale = ref.abs().max().item()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * scale)
    assert torch.equal(out[4], torch.zeros(hidden))
    with pytest.raises(TypeError, match="apply_moe"):
        method.apply(layer, x)


def test_bfloat16_activations_and_the_optional_input_scale() -> None:
    gen = torch.Generator().manual_seed(5)
    experts, hidden, inter = 4, 128, 64
    tensors = quantized_experts(experts, hidden, inter, None, gen)
    for e in range(experts):  # a static-activation export: read, then ignored
        for proj in PROJ_SHAPES:
            tensors[expert_tensor(e, proj, "input_scale")] = torch.tensor(0.01)
    method = TorchFp8MoE(moe_request(fp8(None), hidden, inter, experts, "bfloat16"))
    layer = load_layer(method, tensors)
    assert layer.w13.dtype == torch.bfloat16
    x = torch.randn(9, hidden, generator=gen).to(torch.bfloat16)
    ids, weights = routing(9, experts, 2, gen)
    out = method.apply_moe(layer, x, ids, weights)
    assert out.dtype == torch.bfloat16
    ref = plain_moe(x.float(), ids, weights, tensors, None)
    # bf16 weights, activations and intermediate: a few bf16 steps of the largest output.
    err = (out.double() - ref).abs().max().item()
    assert err <= 2**-5 * ref.abs().max().item(), err


def test_tensor_parallel_shards_sum_to_the_whole() -> None:
    gen = torch.Generator().manual_seed(9)
    experts, hidden, inter, block = 5, 64, 64, (16, 32)
    tensors = quantized_experts(experts, hidden, inter, block, gen)
    x = torch.randn(11, hidden, generator=gen)
    ids, weights = routing(11, experts, 2, gen)
    parts = []
    for rank in range(2):
        method = TorchFp8MoE(moe_request(fp8(block), hidden, inter // 2, experts,
                                         parallel="column", tp_rank=rank, tp_size=2))
        assert method.can_implement(method.request, CPU).accepted
        specs = method.tensor_specs()
        assert specs[expert_tensor(0, "gate_proj", "weight_scale")].shard_dim == 0
        assert specs[expert_tensor(0, "down_proj", "weight_scale")].shape == (4, 1)
        assert specs[expert_tensor(0, "down_proj", "weight_scale")].shard_dim == 1
        parts.append(method.apply_moe(load_layer(method, tensors), x, ids, weights))
    ref = plain_moe(x, ids, weights, tensors, block)
    torch.testing.assert_close((parts[0] + parts[1]).double(), ref, rtol=1e-5,
                               atol=1e-5 * ref.abs().max().item())
