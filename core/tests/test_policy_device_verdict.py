"""Policy from the environment, device specs and probing, and verdict rules."""

from __future__ import annotations

import pytest
from kernelbay import BackendKind, ConfigError, Policy, Verdict, parse_device, probe_device


def test_policy_reads_every_variable_once() -> None:
    env = {"KERNELBAY_PLUGINS": "quant_nvfp4, cpu_amx", "KERNELBAY_DISABLE": "a,b",
           "KERNELBAY_STRICT": "1", "KERNELBAY_DEVICE": "sm_100",
           "KERNELBAY_FORCE_LINEAR": "nvfp4-emulation", "KERNELBAY_BATCH_INVARIANT": "yes"}
    policy = Policy.from_env(env)
    assert policy.plugins == frozenset({"quant_nvfp4", "cpu_amx"})
    assert policy.disable == frozenset({"a", "b"})
    assert policy.strict and policy.batch_invariant
    assert policy.device == "sm_100"
    assert policy.forced(BackendKind.LINEAR) == "nvfp4-emulation"
    assert policy.forced(BackendKind.ATTENTION) is None
    assert hash(policy) == hash(Policy.from_env(env))


def test_unset_allowlist_means_all_and_empty_means_core_only() -> None:
    assert Policy.from_env({}).plugins is None
    assert Policy.from_env({"KERNELBAY_PLUGINS": ""}).plugins == frozenset()


@pytest.mark.parametrize("env, needle", [
    ({"KERNELBAY_STRICT": "maybe"}, "KERNELBAY_STRICT='maybe'"),
    ({"KERNELBAY_FORCE_LINEARS": "x"}, "KERNELBAY_FORCE_LINEAR"),
    ({"KERNELBAY_BATCH_INVARIANT": "2"}, "KERNELBAY_BATCH_INVARIANT"),
])
def test_bad_environment_values_name_the_variable_and_valid_set(env: dict[str, str],
                                                                needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        Policy.from_env(env)


@pytest.mark.parametrize("spec, platform, arch, cc, count", [
    ("sm_90", "cuda", "sm_90", (9, 0), 1),
    ("sm_100", "cuda", "sm_100", (10, 0), 1),
    ("sm_120", "cuda", "sm_120", (12, 0), 1),
    ("sm_89", "cuda", "sm_89", (8, 9), 1),
    ("sm_90x2", "cuda", "sm_90", (9, 0), 2),
    ("gfx950", "rocm", "gfx950", None, 1),
    ("cpu", "cpu", "x86_64", None, 1),
])
def test_device_specs(spec: str, platform: str, arch: str, cc: tuple[int, int] | None,
                      count: int) -> None:
    device = parse_device(spec)
    assert (device.platform, device.arch, device.compute_capability, device.device_count) == (
        platform, arch, cc, count)
    assert device.source.startswith("described")


def test_device_spec_modifiers() -> None:
    amx = parse_device("cpu+amx")
    assert amx.has("amx_bf16") and amx.has("avx512_bf16")
    assert not parse_device("cpu+avx512_bf16").has("amx_bf16")
    assert parse_device("gfx950").has("native_mx") and not parse_device("gfx942").has("native_mx")
    multi = parse_device("sm_90x2+multicast")
    assert multi.multicast is True and multi.p2p is True
    assert parse_device("sm_90x2").multicast is False
    assert parse_device("sm_100").cc_at_least(10) and not parse_device("sm_90").cc_at_least(10)


@pytest.mark.parametrize("spec", ["", "h100", "sm_x", "cpu+quantum", "gfx"])
def test_bad_device_specs_list_the_valid_forms(spec: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_device(spec)
    assert repr(spec) in str(info.value)


def test_probe_reads_this_machine_and_is_cached() -> None:
    device = probe_device()
    assert device is probe_device()
    assert device.source == "probed"
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        flags = next(line for line in f if line.startswith("flags")).split()
    if device.platform == "cpu":
        assert device.has("avx512_bf16") == ("avx512_bf16" in flags)
        assert device.has("amx_bf16") == ("amx_bf16" in flags)


def test_verdict_rules() -> None:
    with pytest.raises(ValueError):
        Verdict.reject("  ")
    ok = Verdict.all(Verdict.accept("a"), Verdict.accept("b"))
    assert ok.accepted and ok.notes == ("a", "b")
    bad = Verdict.all(Verdict.accept(), Verdict.check(False, "first"), Verdict.reject("second"))
    assert not bad and bad.reason == "first"
    assert Verdict.check(True, "unused").accepted
