"""Selection: deterministic order, forcing, disabling, batch invariance, caching, warnings,
and the error that renders the whole trace."""

from __future__ import annotations

import logging
from typing import ClassVar

import pytest
from kernelbay import (
    BackendKind,
    CandidateStatus,
    ForcedBackendError,
    LinearRequest,
    NoBackendError,
    Policy,
    QuantScheme,
    Registry,
    Verdict,
    hookimpl,
    parse_device,
    select,
)
from kernelbay.layers import LinearMethod

CPU = parse_device("cpu")
H200 = parse_device("sm_90")


def linear(name: str, priority: int, needs_cuda: bool = False, invariant: bool = False,
           returns: object = None) -> type[LinearMethod]:
    class Method(LinearMethod):
        """Test linear method."""

        api_version: ClassVar[str] = "1.0"
        summary: ClassVar[str] = "test"

        @classmethod
        def can_implement(cls, request: LinearRequest, device: object) -> Verdict:
            if returns is not None:
                return returns  # type: ignore[return-value]
            platform = getattr(device, "platform", "?")
            return Verdict.check(not needs_cuda or platform == "cuda",
                                 f"needs a cuda device, device is {platform!r}")

    Method.name = name  # type: ignore[misc]
    Method.priority = priority  # type: ignore[misc]
    Method.batch_invariant = invariant  # type: ignore[misc]
    return Method


def registry_with(*classes: type[LinearMethod], policy: Policy | None = None) -> Registry:
    class Plugin:
        KERNELBAY_PLUGIN_API = "1.0"

        @hookimpl
        def kernelbay_linear_methods(self) -> list[type[LinearMethod]]:
            return list(classes)

    registry = Registry(policy or Policy())
    registry.register(Plugin(), "testplugin")
    return registry


REQ = LinearRequest(128, 256)


def test_priority_then_name_order_and_full_trace() -> None:
    registry = registry_with(linear("b-fast", 50), linear("a-fast", 50), linear("slow", 5))
    selection = select(BackendKind.LINEAR, REQ, CPU, registry=registry)
    assert selection.name == "a-fast"
    assert [t.backend for t in selection.trace] == ["a-fast", "b-fast", "slow",
                                                     "torch-fp8-dequant", "torch-fp8-moe",
                                                     "torch-moe", "torch-unquantized"]
    assert [t.chosen for t in selection.trace] == [True, False, False, False, False, False,
                                                   False]
    assert [t.status for t in selection.trace] == [CandidateStatus.ACCEPTED] * 3 + [
        CandidateStatus.REJECTED, CandidateStatus.REJECTED, CandidateStatus.REJECTED,
        CandidateStatus.ACCEPTED]


def test_rejection_falls_back_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    registry = registry_with(linear("gpu-only", 90, needs_cuda=True))
    with caplog.at_level(logging.WARNING, logger="kernelbay.select"):
        first = select(BackendKind.LINEAR, REQ, CPU, registry=registry)
        select(BackendKind.LINEAR, LinearRequest(64, 64), CPU, registry=registry)
    assert first.name == "torch-unquantized"
    warnings = [r for r in caplog.records if "gpu-only" in r.getMessage()]
    assert len(warnings) == 1
    assert "needs a cuda device, device is 'cpu'" in warnings[0].getMessage()
    on_gpu = select(BackendKind.LINEAR, REQ, H200, registry=registry)
    assert on_gpu.name == "gpu-only"


def test_dense_method_is_not_applicable_to_routed_experts(
        caplog: pytest.LogCaptureFixture) -> None:
    """A linear method that is not a ``MoEMethod`` never takes a routed-expert request, even
    when its ``can_implement`` accepts everything: the trace says why, no fallback warning is
    logged, and the experts go to a ``MoEMethod``; dense requests still go to it."""
    from kernelbay.layers.moe import MOE_EXPERTS_ROLE

    registry = registry_with(linear("accepts-all", 90))
    experts = LinearRequest(128, 256, role=MOE_EXPERTS_ROLE, num_experts=8)
    with caplog.at_level(logging.WARNING, logger="kernelbay.select"):
        selection = select(BackendKind.LINEAR, experts, CPU, registry=registry)
    assert selection.name == "torch-moe"
    line = next(t for t in selection.trace if t.backend == "accepts-all")
    assert line.status is CandidateStatus.REJECTED and not line.applicable
    assert "not a MoEMethod" in line.reason and "8 routed experts" in line.reason
    assert not [r for r in caplog.records if "accepts-all" in r.getMessage()]
    assert select(BackendKind.LINEAR, REQ, CPU, registry=registry).name == "accepts-all"


def test_decisions_are_cached_per_request_device_and_policy() -> None:
    registry = registry_with(linear("x", 1))
    a = select(BackendKind.LINEAR, REQ, CPU, registry=registry)
    assert select(BackendKind.LINEAR, LinearRequest(128, 256), CPU, registry=registry) is a
    assert select(BackendKind.LINEAR, REQ, H200, registry=registry) is not a


def test_forced_backend_wins_over_priority() -> None:
    policy = Policy().with_force(BackendKind.LINEAR, "slow")
    registry = registry_with(linear("fast", 50), linear("slow", 5), policy=policy)
    assert select(BackendKind.LINEAR, REQ, CPU, registry=registry).name == "slow"


def test_forced_backend_that_rejects_raises_its_reason() -> None:
    policy = Policy().with_force(BackendKind.LINEAR, "gpu-only")
    registry = registry_with(linear("gpu-only", 90, needs_cuda=True), policy=policy)
    with pytest.raises(ForcedBackendError) as info:
        select(BackendKind.LINEAR, REQ, CPU, registry=registry)
    message = str(info.value)
    assert "KERNELBAY_FORCE_LINEAR='gpu-only'" in message
    assert "needs a cuda device, device is 'cpu'" in message


def test_forcing_an_unknown_name_lists_the_valid_ones() -> None:
    policy = Policy().with_force(BackendKind.LINEAR, "nope")
    registry = registry_with(linear("fast", 50), policy=policy)
    with pytest.raises(ForcedBackendError,
                       match=r"valid: \['fast', 'torch-fp8-dequant', 'torch-fp8-moe', "
                             r"'torch-moe', "
                             r"'torch-unquantized'\]"):
        select(BackendKind.LINEAR, REQ, CPU, registry=registry)


def test_disabled_backend_is_blocked_in_the_trace() -> None:
    policy = Policy(disable=frozenset({"fast"}))
    registry = registry_with(linear("fast", 50), policy=policy)
    selection = select(BackendKind.LINEAR, REQ, CPU, registry=registry)
    assert selection.name == "torch-unquantized"
    (line,) = [t for t in selection.trace if t.backend == "fast"]
    assert line.status is CandidateStatus.BLOCKED and "KERNELBAY_DISABLE" in line.reason
    forced = Policy(disable=frozenset({"fast"})).with_force(BackendKind.LINEAR, "fast")
    with pytest.raises(ForcedBackendError, match="KERNELBAY_DISABLE"):
        select(BackendKind.LINEAR, REQ, CPU, registry=registry_with(linear("fast", 50),
                                                                      policy=forced))


def test_batch_invariant_policy_prefers_declared_candidates() -> None:
    classes = (linear("fast", 50), linear("steady", 10, invariant=True))
    plain = select(BackendKind.LINEAR, REQ, CPU, registry=registry_with(*classes))
    assert plain.name == "fast"
    invariant = select(BackendKind.LINEAR, REQ, CPU,
                       registry=registry_with(*classes, policy=Policy(batch_invariant=True)))
    assert invariant.name == "steady"


def test_non_verdict_answer_becomes_a_rejection() -> None:
    registry = registry_with(linear("sloppy", 99, returns=True))
    selection = select(BackendKind.LINEAR, REQ, CPU, registry=registry)
    (line,) = [t for t in selection.trace if t.backend == "sloppy"]
    assert line.status is CandidateStatus.REJECTED
    assert "expected a Verdict" in line.reason


def test_nothing_accepts_renders_trace_and_what_to_install() -> None:
    nvfp4 = QuantScheme("nvfp4", "e2m1", (1, 16), "float8_e4m3fn", True, None, "modelopt")
    registry = registry_with(linear("gpu-only", 90, needs_cuda=True))
    with pytest.raises(NoBackendError) as info:
        select(BackendKind.LINEAR, LinearRequest(4096, 4096, nvfp4), CPU, registry=registry)
    message = str(info.value)
    assert "no linear method accepts" in message
    assert "torch-unquantized" in message and "handles unquantized weights only" in message
    assert "gpu-only" in message
    assert "pip install kernelbay-quant-nvfp4" in message
    assert [t.backend for t in info.value.trace] == ["gpu-only", "torch-fp8-dequant",
                                                     "torch-fp8-moe", "torch-moe",
                                                     "torch-unquantized"]


def test_selection_render_and_json_are_stable() -> None:
    selection = select(BackendKind.LINEAR, REQ, CPU, registry=registry_with(linear("x", 1)))
    text = selection.render()
    assert text.splitlines()[0].startswith("linear method for other K=128 -> N=256")
    assert selection.as_dict()["chosen"] == "x"
    assert [t["backend"] for t in selection.as_dict()["trace"]] == [
        "x", "torch-fp8-dequant", "torch-fp8-moe", "torch-moe", "torch-unquantized"]
