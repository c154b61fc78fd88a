"""Which requests and devices each collective accepts, and the reasons it gives otherwise."""

from __future__ import annotations

import pytest
from kernelbay import CollectiveRequest, parse_device
from kernelbay_tp_collectives.checks import MULTICAST_SWITCHES, multicast_switched_off
from kernelbay_tp_collectives.fused import FusedGemmAllReduce
from kernelbay_tp_collectives.two_shot import SymmMemTwoShotAllReduce


@pytest.fixture(autouse=True)
def _no_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in MULTICAST_SWITCHES:
        monkeypatch.delenv(name, raising=False)


def _req(op: str = "all_reduce", world: int = 2, transport: str = "nccl") -> CollectiveRequest:
    return CollectiveRequest(op, world, "bfloat16", transport)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_two_shot_accepts_peer_devices(world: int) -> None:
    device = parse_device(f"sm_90x{world}")
    for op in ("all_reduce", "gemm_all_reduce"):
        assert SymmMemTwoShotAllReduce.can_implement(_req(op, world), device).accepted


@pytest.mark.parametrize("request_, spec, needle", [
    (_req(transport="gloo"), "sm_90x2", "needs the nccl transport, request asks 'gloo'"),
    (_req(), "cpu", "needs a CUDA device, device is 'cpu'"),
    (_req(), "gfx942x2", "needs a CUDA device, device is 'rocm'"),
    (_req(world=1), "sm_90", "needs 2..8 ranks, request has 1"),
    (_req(world=16), "sm_90x16", "needs 2..8 ranks, request has 16"),
    (_req(world=4), "sm_90x2", "needs 4 devices on this host, device has 2"),
    (_req(), "sm_90", "needs 2 devices on this host, device has 1"),
])
def test_two_shot_rejections_name_the_numbers(request_: CollectiveRequest, spec: str,
                                              needle: str) -> None:
    verdict = SymmMemTwoShotAllReduce.can_implement(request_, parse_device(spec))
    assert not verdict.accepted
    assert needle in verdict.reason


def test_two_shot_sums_bf16_and_fp32_only() -> None:
    request = CollectiveRequest("all_reduce", 2, "float16", "nccl")
    verdict = SymmMemTwoShotAllReduce.can_implement(request, parse_device("sm_90x2"))
    assert not verdict.accepted
    assert "sums dtypes ('bfloat16', 'float32'), request has 'float16'" in verdict.reason


def test_two_shot_needs_peer_access() -> None:
    from dataclasses import replace

    device = replace(parse_device("sm_90x2"), p2p=False)
    verdict = SymmMemTwoShotAllReduce.can_implement(_req(), device)
    assert not verdict.accepted and "p2p=False" in verdict.reason


def test_two_shot_does_not_handle_gather() -> None:
    verdict = SymmMemTwoShotAllReduce.can_implement(_req("all_gather"), parse_device("sm_90x2"))
    assert not verdict.accepted and not verdict.applicable


def test_fused_needs_multicast() -> None:
    verdict = FusedGemmAllReduce.can_implement(_req("gemm_all_reduce"), parse_device("sm_90x2"))
    assert not verdict.accepted
    assert "needs multicast (NVLS) between the devices, device 'sm_90' reports " \
        "multicast=False" in verdict.reason
    accepted = FusedGemmAllReduce.can_implement(_req("gemm_all_reduce"),
                                                parse_device("sm_90x2+multicast"))
    assert accepted.accepted


def test_fused_handles_gemm_all_reduce_only() -> None:
    verdict = FusedGemmAllReduce.can_implement(_req("all_reduce"),
                                               parse_device("sm_90x2+multicast"))
    assert not verdict.accepted and not verdict.applicable


@pytest.mark.parametrize("name", sorted(MULTICAST_SWITCHES))
def test_environment_switch_turns_multicast_off(monkeypatch: pytest.MonkeyPatch,
                                                name: str) -> None:
    monkeypatch.setenv(name, MULTICAST_SWITCHES[name])
    verdict = FusedGemmAllReduce.can_implement(_req("gemm_all_reduce"),
                                               parse_device("sm_90x2+multicast"))
    assert not verdict.accepted
    assert f"switches off ({name}={MULTICAST_SWITCHES[name]})" in verdict.reason


def test_switches_read_only_their_off_values() -> None:
    assert multicast_switched_off({"NCCL_NVLS_ENABLE": "1"}) == []
    assert multicast_switched_off({"NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1",
                                   "TORCH_SYMM_MEM_DISABLE_MULTICAST": "0"}) == [
        "NCCL_NVLS_ENABLE=0", "NVSHMEM_DISABLE_NVLS=1"]


def test_probed_multicast_respects_the_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    from kernelbay.device import _probe_multicast

    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    assert _probe_multicast(0) is False
