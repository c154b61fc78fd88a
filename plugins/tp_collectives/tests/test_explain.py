"""``kernelbay explain --tp 2`` shows the collectives chosen and why the fused GEMM +
all-reduce was passed over."""

from __future__ import annotations

import os

import pytest
from kernelbay import Policy, Registry, parse_device
from kernelbay.cli.explain import render_plan
from kernelbay.plan import plan_checkpoint
from kernelbay_tp_collectives.checks import MULTICAST_SWITCHES

DEMO = os.path.join(os.path.dirname(__import__("kernelbay.demo").demo.__file__))


@pytest.fixture(autouse=True)
def _no_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in MULTICAST_SWITCHES:
        monkeypatch.delenv(name, raising=False)


def _plan(spec: str, policy: Policy | None = None) -> str:
    registry = Registry.discover(policy or Policy(plugins=frozenset({"tp_collectives"})))
    plan = plan_checkpoint(DEMO, device=parse_device(spec), registry=registry, tp_size=2)
    assert plan.ok
    assert plan.collective is not None and plan.gemm_collective is not None
    return render_plan(plan)


def test_without_multicast_the_fused_path_is_passed_over_with_its_reason() -> None:
    # The symmetric-memory all-reduce leads NCCL (it routes large messages to NCCL itself).
    text = _plan("sm_90x2")
    assert "collective: tp-symm-mem-two-shot  [all_reduce over 2 ranks (nccl" in text
    assert "gemm + all-reduce: tp-symm-mem-two-shot" in text
    assert ("passed over: tp-fused-gemm-all-reduce: needs multicast (NVLS) between the "
            "devices, device 'sm_90' reports multicast=False") in text


def test_nccl_can_still_be_forced() -> None:
    policy = Policy.make(plugins=["tp_collectives"], force={"collective": "torch-distributed"})
    text = _plan("sm_90x2", policy)
    assert "collective: torch-distributed  [all_reduce over 2 ranks (nccl" in text
    assert "gemm + all-reduce: torch-distributed" in text


def test_with_multicast_the_fused_path_is_chosen() -> None:
    assert "gemm + all-reduce: tp-fused-gemm-all-reduce" in _plan("sm_90x2+multicast")


def test_switched_off_multicast_wins_over_the_description(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    text = _plan("sm_90x2+multicast")
    assert "gemm + all-reduce: tp-symm-mem-two-shot" in text
    assert "switches off (NCCL_NVLS_ENABLE=0)" in text


def test_cpu_plans_keep_the_reference() -> None:
    text = _plan("cpu")
    assert "collective: torch-distributed  [all_reduce over 2 ranks (gloo" in text


@pytest.mark.parametrize("spec, chosen, reason", [
    ("sm_90x2", "tp-symm-mem-two-shot", "reports multicast=False"),
    ("sm_90x2+multicast", "tp-fused-gemm-all-reduce", None),
])
def test_explain_command(spec: str, chosen: str, reason: str | None,
                         monkeypatch: pytest.MonkeyPatch,
                         capsys: pytest.CaptureFixture[str]) -> None:
    from kernelbay.cli import main

    monkeypatch.setenv("KERNELBAY_PLUGINS", "tp_collectives")
    assert main(["explain", DEMO, "--device", spec, "--tp", "2"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("gemm + all-reduce:"))
    assert line.startswith(f"gemm + all-reduce: {chosen}")
    if reason is not None:
        assert f"tp-fused-gemm-all-reduce: needs multicast (NVLS) between the devices, " \
               f"device 'sm_90' {reason}" in out
