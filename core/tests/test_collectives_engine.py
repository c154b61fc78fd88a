"""The engine's row-parallel layers: GEMM then all-reduce by default, the collective's
fused GEMM + all-reduce when one was selected and the layer is a plain dense matrix."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from kernelbay import LayerRole, LinearRequest, QuantScheme
from kernelbay.engine.modules import Linear
from kernelbay.engine.parallel import TensorParallel
from kernelbay.layers.torch_linear import TorchUnquantizedLinear


class _Recorder:
    """A stand-in collective that doubles (as if a twin rank held the same partial sum)
    and records which entry point the layer used."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append("all_reduce")
        return x * 2

    def gemm_all_reduce(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        self.calls.append("gemm_all_reduce")
        return torch.nn.functional.linear(x, weight) * 2


def _layer(tp: TensorParallel, bias: bool = False, rank: int = 0) -> Linear:
    request = LinearRequest(12, 5, activation_dtype="float32", bias=bias,
                            role=LayerRole.ATTN_OUT, parallel="row", tp_rank=rank, tp_size=2)
    layer = Linear(TorchUnquantizedLinear(request), tp, torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return layer


@pytest.mark.parametrize("fused", [False, True])
def test_row_parallel_uses_the_fused_collective_only_when_selected(fused: bool) -> None:
    plain, gemm = _Recorder(), _Recorder()
    tp = TensorParallel(0, 2, None, plain, gemm if fused else None)
    layer = _layer(tp)
    x = torch.randn(3, 4, 12)
    y = layer(x)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, layer.weight) * 2)
    assert plain.calls == ([] if fused else ["all_reduce"])
    assert gemm.calls == (["gemm_all_reduce"] if fused else [])


def test_bias_on_this_rank_keeps_gemm_then_all_reduce() -> None:
    plain, gemm = _Recorder(), _Recorder()
    layer = _layer(TensorParallel(0, 2, None, plain, gemm), bias=True, rank=0)
    assert not layer.fusable
    layer(torch.randn(2, 12))
    assert plain.calls == ["all_reduce"] and gemm.calls == []
    other = _layer(TensorParallel(1, 2, None, plain, gemm), bias=True, rank=1)
    assert other.fusable  # rank 1 adds no bias: the fused path may run it


def test_quantized_row_layer_is_not_fusable() -> None:
    request = LinearRequest(128, 16, QuantScheme("fp8", "float8_e4m3fn"), "float32",
                            role=LayerRole.MLP_DOWN, parallel="row", tp_size=2)

    class _Quantized(TorchUnquantizedLinear):
        def __init__(self, req: Any) -> None:
            super().__init__(req)

    layer = Linear(_Quantized(request), TensorParallel(0, 2, None, _Recorder(), _Recorder()),
                   torch.device("cpu"))
    assert not layer.fusable


def test_plan_records_the_gemm_all_reduce_decision() -> None:
    from kernelbay import Policy, Registry, parse_device
    from kernelbay.cli.explain import render_plan, summary_lines
    from kernelbay.demo import demo_path
    from kernelbay.plan import plan_checkpoint

    plan = plan_checkpoint(demo_path(), device=parse_device("cpu"), tp_size=2,
                           registry=Registry(Policy(plugins=frozenset())))
    assert plan.ok and plan.gemm_collective is not None
    assert plan.gemm_collective.chosen == "torch-distributed"
    assert plan.as_dict()["gemm_collective"]["request"] == (  # type: ignore[index]
        "gemm_all_reduce over 2 ranks (gloo, bfloat16)")
    assert "gemm + all-reduce: torch-distributed" in render_plan(plan)
    assert "  gemm + all-reduce: torch-distributed" in summary_lines(plan)
    assert plan.gather_collective is not None
    assert plan.as_dict()["gather_collective"]["request"] == (  # type: ignore[index]
        "all_gather over 2 ranks (gloo, bfloat16)")
    assert "  all-gather: torch-distributed" in summary_lines(plan)
    single = plan_checkpoint(demo_path(), device=parse_device("cpu"),
                             registry=Registry(Policy(plugins=frozenset())))
    assert single.gemm_collective is None and single.collective is None
    assert single.gather_collective is None


class _ReduceOnly(_Recorder):
    """An all-reduce-only backend, as the symmetric-memory one is: no all_gather."""

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        raise AssertionError("the all-reduce backend was asked to all-gather")


class _Gather:
    """A stand-in all-gather over two ranks holding the same shard."""

    def __init__(self) -> None:
        self.calls = 0

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        self.calls += 1
        return torch.cat([x, x], dim=dim)


def test_vocab_logits_gather_through_the_all_gather_collective() -> None:
    """The logits are gathered by the collective selected for all-gather, never by the one
    selected for all-reduce (which may implement nothing else)."""
    from kernelbay.engine.modules import VocabParallelEmbedding, vocab_logits

    gather = _Gather()
    tp = TensorParallel(0, 2, None, _ReduceOnly(), None, gather)
    embed = VocabParallelEmbedding(10, 4, tp, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        embed.weight.copy_(torch.randn(embed.weight.shape))
    x = torch.randn(3, 4)
    logits = vocab_logits(x, None, embed)
    shard = torch.nn.functional.linear(x, embed.weight)
    torch.testing.assert_close(logits, torch.cat([shard, shard], dim=-1)[..., :10])
    assert gather.calls == 1
