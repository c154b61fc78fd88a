"""Each hook, implemented by an inline plugin, reaches selection (or the device)."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
from kernelbay import (
    AttentionRequest,
    BackendKind,
    CollectiveRequest,
    DeviceCapability,
    FormatRequest,
    LinearRequest,
    Policy,
    ProposerRequest,
    QuantScheme,
    Registry,
    Verdict,
    hookimpl,
    parse_device,
    select,
)
from kernelbay.layers import (
    AttentionBackend,
    CheckpointFormat,
    Collective,
    LinearMethod,
    Proposer,
)

CPU = parse_device("cpu")


def _accepting(base: type[Any], name: str) -> type[Any]:
    class Accepting(base):  # type: ignore[misc, valid-type]
        """Accepts everything (test double)."""

        api_version: ClassVar[str] = "1.0"
        priority: ClassVar[int] = 99
        summary: ClassVar[str] = "test"

        @classmethod
        def can_implement(cls, request: object, device: object) -> Verdict:
            return Verdict.accept("test double")

        def scheme_for(self, module: str) -> QuantScheme:
            return QuantScheme("test")

    Accepting.name = name
    return Accepting


CASES = [
    ("kernelbay_checkpoint_formats", BackendKind.CHECKPOINT_FORMAT, CheckpointFormat,
     FormatRequest.from_config({"quant_method": "x"})),
    ("kernelbay_linear_methods", BackendKind.LINEAR, LinearMethod, LinearRequest(8, 8)),
    ("kernelbay_attention_backends", BackendKind.ATTENTION, AttentionBackend,
     AttentionRequest("mla", 16, 1, 192, 128, 512, 64)),
    ("kernelbay_proposers", BackendKind.PROPOSER, Proposer, ProposerRequest("x", 4, 10)),
    ("kernelbay_collectives", BackendKind.COLLECTIVE, Collective,
     CollectiveRequest("all_reduce", 2)),
]


@pytest.mark.parametrize("hook, kind, base, request_", CASES, ids=[c[0] for c in CASES])
def test_hook_offers_reach_selection(hook: str, kind: BackendKind, base: type[Any],
                                     request_: object) -> None:
    cls = _accepting(base, f"test-{kind.value.replace('_', '-')}")
    plugin = type("Plugin", (), {"KERNELBAY_PLUGIN_API": "1.0",
                                 hook: hookimpl(lambda self: [cls])})()
    registry = Registry(Policy(plugins=frozenset()))
    record = registry.register(plugin, "inline")
    assert record.offers_of(kind) == (cls.name,)
    assert kind.hook_name == hook
    chosen = select(kind, request_, CPU, registry=registry)
    assert chosen.backend is cls and chosen.verdict.notes == ("test double",)


def test_kernelbay_device_probes_describe_and_probe_vendor_devices() -> None:
    class Probe:
        name = "npu"

        def probe(self) -> DeviceCapability | None:
            return DeviceCapability("npu", "npu1", source="probed")

        def parse(self, spec: str) -> DeviceCapability | None:
            return DeviceCapability("npu", spec, source="described") if spec == "npu9" else None

    plugin = type("Plugin", (), {"KERNELBAY_PLUGIN_API": "1.0",
                                 "kernelbay_device_probes": hookimpl(lambda self: [Probe()])})()
    probed = Registry(Policy(plugins=frozenset()))
    probed.register(plugin, "npu")
    assert probed.device().arch == "npu1"
    described = Registry(Policy(plugins=frozenset(), device="npu9"))
    described.register(plugin, "npu")
    assert described.device().arch == "npu9"
    fallback = Registry(Policy(plugins=frozenset(), device="sm_90"))
    fallback.register(plugin, "npu")
    assert fallback.device().platform == "cuda"


def test_a_raising_device_probe_is_recorded_not_fatal() -> None:
    class Broken:
        name = "broken"

        def probe(self) -> DeviceCapability | None:
            raise OSError("driver missing")

        def parse(self, spec: str) -> DeviceCapability | None:
            return None

    plugin = type("Plugin", (), {"KERNELBAY_PLUGIN_API": "1.0",
                                 "kernelbay_device_probes": hookimpl(lambda self: [Broken()])})()
    registry = Registry(Policy(plugins=frozenset()))
    registry.register(plugin, "broken")
    assert registry.device().source == "probed"
    assert any("driver missing" in note for note in registry.notes)
