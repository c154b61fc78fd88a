"""Code that must be capturable in a CUDA graph, on the CPU: the testing kit's simulated
capture (what it rejects, what it lets through) and the MoE routing's capturable path."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from kernelbay.capture import CaptureRefused, capturable_paths, is_capturing, kernelbay_line
from kernelbay.layers import moe
from kernelbay.layers.moe import combine_experts
from kernelbay.testing.capture import CaptureViolation, simulated_capture

X = torch.arange(12.0).reshape(3, 4)


@pytest.mark.parametrize("name, host_read", [
    ("Tensor.tolist", lambda: X.tolist()),
    ("_local_scalar_dense", lambda: X[0, 0].item()),
    ("_local_scalar_dense", lambda: bool(X.sum() > 0)),
    ("nonzero", lambda: X.nonzero()),
    ("_unique2", lambda: torch.unique(X)),
    ("index.Tensor", lambda: X[X > 3]),
    ("index_put", lambda: X.clone().__setitem__(X > 3, 0.0)),
    ("repeat_interleave", lambda: torch.repeat_interleave(torch.arange(3), torch.arange(3))),
    ("torch.tensor", lambda: torch.tensor([1.0, 2.0], device=X.device)),
    ("torch.as_tensor", lambda: torch.as_tensor(1.0, device=X.device)),
    ("Tensor.new_tensor", lambda: X.new_tensor([1.0])),
])
def test_a_simulated_capture_rejects_host_reads_naming_the_op(name: str, host_read: Any) -> None:
    with simulated_capture(), pytest.raises(CaptureViolation, match=name.replace(".", r"\.")):
        host_read()
    host_read()  # and allows it again once the capture ends


def test_a_simulated_capture_lets_device_side_work_through() -> None:
    counts = torch.tensor([1, 0, 2])
    with simulated_capture():
        assert is_capturing(X)
        y = X.clone()
        y[torch.tensor([0, 2])] = 0.0  # an index tensor and a scalar: no host read
        rep = torch.repeat_interleave(torch.arange(3), counts, output_size=3)
        made = torch.tensor([1.0, 2.0])  # a host tensor, no device named
        z = torch.where(X > 3, X, 0.0).sum(-1)
    assert not is_capturing(X)
    assert y[1].equal(X[1]) and rep.tolist() == [0, 2, 2] and made.tolist() == [1.0, 2.0]
    assert z.tolist() == [0.0, 22.0, 38.0]


def test_capturable_paths_make_code_take_its_capture_path_without_a_capture() -> None:
    assert not is_capturing(X)
    with capturable_paths():
        assert is_capturing(X)
        X.tolist()  # nothing is rejected: no capture is being simulated
    assert not is_capturing(X)


def _routing(tokens: int, experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 8, generator=gen)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    weights[0] = 0.0  # a token whose routed weights are zero
    return x, ids, weights


def test_captured_routing_runs_every_expert_and_equals_the_eager_sum() -> None:
    """Every expert on every token with the unrouted rows masked gives exactly the routed
    sum, including experts that give inf or NaN on rows not routed to them."""
    experts, top_k = 6, 2
    weights_of = torch.randn(experts, 8, 5, generator=torch.Generator().manual_seed(1))
    for tokens, seed in ((1, 0), (3, 1), (7, 2)):
        x, ids, weights = _routing(tokens, experts, top_k, seed)
        poison = int(ids[0, 0])
        calls: list[tuple[int, int]] = []

        def expert(e: int, rows: torch.Tensor, x: torch.Tensor = x, ids: torch.Tensor = ids,
                   poison: int = poison, calls: list[tuple[int, int]] = calls) -> torch.Tensor:
            calls.append((e, rows.numel()))
            y = x[rows] @ weights_of[e]
            if e == poison:  # inf and NaN on every row that expert is not routed
                routed = (ids[rows] == e).any(-1, keepdim=True)
                junk = torch.tensor([float("nan"), float("inf")]).repeat(3)[:y.shape[1]]
                y = torch.where(routed, y, junk)
            return y

        want = combine_experts(x, ids, weights, 5, expert)
        assert len(calls) == len(torch.unique(ids))
        calls.clear()
        with simulated_capture():
            got = combine_experts(x, ids, weights, 5, expert, num_experts=experts)
        assert calls == [(e, tokens) for e in range(experts)]
        assert torch.equal(got, want), (got - want).abs().max()


def test_captured_routing_needs_the_expert_count_and_refuses_costly_batches(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the expert count a capture is an error; a batch so small that reading every
    expert costs over the ratio, or so large that every expert's rows cost, is refused
    (``CaptureRefused``: the engine runs it eagerly)."""
    x, ids, weights = _routing(1, 8, 2, 0)

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        return x[rows]

    with simulated_capture(), pytest.raises(RuntimeError, match="needs num_experts"):
        combine_experts(x, ids, weights, 8, expert)
    monkeypatch.setattr(moe, "CAPTURED_EXPERTS_PER_ROUTED", 3)
    with simulated_capture(), pytest.raises(CaptureRefused, match="read all 8 experts for 1 "
                                                                  "tokens, more than 3x the at "
                                                                  "most 2 routed"):
        combine_experts(x, ids, weights, 8, expert, num_experts=8)
    monkeypatch.setattr(moe, "CAPTURED_EXPERTS_PER_ROUTED", 4)
    with simulated_capture():
        combine_experts(x, ids, weights, 8, expert, num_experts=8)
    x, ids, weights = _routing(5, 8, 2, 1)
    monkeypatch.setattr(moe, "CAPTURED_MAX_TOKENS", 4)
    with simulated_capture(), pytest.raises(CaptureRefused, match="each of 5 tokens, more "
                                                                  "than CAPTURED_MAX_TOKENS=4"):
        combine_experts(x, ids, weights, 8, expert, num_experts=8)


def test_the_kernelbay_line_is_inside_an_imported_kernelbay_package(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only files of the imported core and plugin packages count, named from the package
    folder (a checkout or environment folder named like the project above them does not),
    and the capture machinery itself is skipped."""
    import os
    import traceback
    import types

    import kernelbay

    def frame(path: str) -> traceback.FrameSummary:
        return traceback.FrameSummary(path, 7, "f")

    plugin = types.ModuleType("kernelbay_acme")
    plugin.__file__ = os.path.join(str(tmp_path), "kernelbay_acme", "__init__.py")
    monkeypatch.setitem(sys.modules, "kernelbay_acme", plugin)
    core = os.path.dirname(kernelbay.__file__)
    moe_file = os.path.join(core, "layers", "moe.py")
    assert kernelbay_line([frame(moe_file)]) == "kernelbay/layers/moe.py:7 in f"
    assert kernelbay_line([frame(moe_file), frame(os.path.join(str(tmp_path), "kernelbay_acme",
                                                               "attn.py"))]) == (
        "kernelbay_acme/attn.py:7 in f")
    outside = os.path.join(str(tmp_path), "kernelbay", "tests", "test_x.py")
    assert kernelbay_line([frame(moe_file), frame(outside)]) == "kernelbay/layers/moe.py:7 in f"
    assert kernelbay_line([frame(os.path.join(core, "engine", "graphs.py"))]) is None
