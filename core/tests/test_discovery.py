"""Discovery and fault isolation: every broken plugin is recorded, the core keeps working,
and strict mode turns each fault into an error."""

from __future__ import annotations

import importlib.metadata as metadata

import pytest
from kernelbay import (
    BackendKind,
    CandidateStatus,
    ConfigError,
    LinearRequest,
    PluginError,
    PluginStatus,
    Policy,
    Registry,
    parse_device,
    select,
)

GROUP = "kernelbay.plugins"
CPU = parse_device("cpu")


def ep(name: str, value: str) -> metadata.EntryPoint:
    return metadata.EntryPoint(name=name, value=value, group=GROUP)


ALL_FAULTS = [
    ep("good", "kb_fake_good"),
    ep("boom", "kb_fake_import_error"),
    ep("raiser", "kb_fake_raising_probe"),
    ep("old", "kb_fake_old_api"),
    ep("dup_a", "kb_fake_duplicate:first"),
    ep("dup_b", "kb_fake_duplicate:second"),
    ep("garbage", "kb_fake_garbage"),
]


def discover(policy: Policy | None = None, eps: list[metadata.EntryPoint] | None = None
             ) -> Registry:
    return Registry.discover(policy or Policy(), entry_points=ALL_FAULTS if eps is None else eps)


def test_every_fault_is_recorded_and_the_core_keeps_working() -> None:
    registry = discover()
    status = {r.name: r.status for r in registry.records}
    assert status == {
        "core": PluginStatus.LOADED,
        "good": PluginStatus.LOADED,
        "boom": PluginStatus.FAILED,
        "raiser": PluginStatus.LOADED,
        "old": PluginStatus.INCOMPATIBLE,
        "dup_a": PluginStatus.PARTIAL,
        "dup_b": PluginStatus.PARTIAL,
        "garbage": PluginStatus.PARTIAL,
    }
    assert "fake plugin exploded at import" in registry.record("boom").reason
    assert "0.3" in registry.record("old").reason and "1.0" in registry.record("old").reason
    garbage = registry.record("garbage")
    assert any("42" in p for p in garbage.problems)
    assert any("attention hook broke" in p for p in garbage.problems)
    assert any("'ngram'" in p for p in garbage.problems)
    # The core still selects, and the trace shows every fault relevant to linear methods.
    selection = select(BackendKind.LINEAR, LinearRequest(64, 64), CPU, registry=registry)
    assert selection.name == "torch-unquantized"
    by_backend = {(t.backend, t.plugin): t for t in selection.trace}
    assert by_backend[("fake-raising", "raiser")].status is CandidateStatus.REJECTED
    assert "ZeroDivisionError" in by_backend[("fake-raising", "raiser")].reason
    assert by_backend[("<boom>", "boom")].status is CandidateStatus.FAILED
    assert by_backend[("<old>", "old")].status is CandidateStatus.INCOMPATIBLE
    assert by_backend[("fake-dup", "dup_a")].status is CandidateStatus.BLOCKED
    assert "dup_b" in by_backend[("fake-dup", "dup_a")].reason
    assert by_backend[("fake-dup", "dup_b")].status is CandidateStatus.BLOCKED
    assert by_backend[("<garbage>", "garbage")].status is CandidateStatus.FAILED


def test_duplicate_resolution_does_not_depend_on_order() -> None:
    forward = discover()
    backward = Registry.discover(Policy(), entry_points=list(reversed(ALL_FAULTS)))
    assert [r.as_dict() for r in forward.records] == [r.as_dict() for r in backward.records]


def test_duplicate_of_a_core_name_keeps_the_core_backend() -> None:
    from kernelbay.layers.torch_linear import TorchUnquantizedLinear

    class Impostor(TorchUnquantizedLinear):
        """Reuses the core's name."""

    class Plugin:
        KERNELBAY_PLUGIN_API = "1.0"

        @staticmethod
        def kernelbay_linear_methods() -> list[type]:
            return [Impostor]

    from kernelbay import hookimpl

    Plugin.kernelbay_linear_methods = hookimpl(Plugin.kernelbay_linear_methods)  # type: ignore[method-assign]
    registry = Registry(Policy())
    record = registry.register(Plugin(), "impostor")
    assert record.status is PluginStatus.PARTIAL
    (candidate,) = [c for c in registry.candidates(BackendKind.LINEAR)
                    if c.name == "torch-unquantized"]
    assert candidate.plugin == "core"


@pytest.mark.parametrize("name", ["boom", "raiser", "old", "dup_a", "garbage"])
def test_strict_mode_turns_each_fault_into_an_error(name: str) -> None:
    eps = [e for e in ALL_FAULTS if e.name == name]
    if name == "dup_a":
        eps = [e for e in ALL_FAULTS if e.name in ("dup_a", "dup_b")]
    strict = Policy(strict=True)
    with pytest.raises(PluginError) as info:
        registry = Registry.discover(strict, entry_points=eps)
        select(BackendKind.LINEAR, LinearRequest(64, 64), CPU, registry=registry)
    assert info.value.plugin in {e.name for e in eps} | {"kb_fake_raising_probe"}


def test_allowlist_loads_only_named_plugins_and_reports_unknown_names() -> None:
    registry = discover(Policy(plugins=frozenset({"good", "nonexistent"})))
    status = {r.name: r.status for r in registry.records}
    assert status["good"] is PluginStatus.LOADED
    assert status["boom"] is PluginStatus.NOT_ALLOWED
    assert any("'nonexistent'" in n for n in registry.notes)
    with pytest.raises(ConfigError, match="nonexistent"):
        discover(Policy(plugins=frozenset({"nonexistent"}), strict=True))


def test_empty_allowlist_means_core_only() -> None:
    registry = discover(Policy(plugins=frozenset()))
    loaded = [r.name for r in registry.records if r.status is PluginStatus.LOADED]
    assert loaded == ["core"]


def test_disabled_plugin_is_not_imported() -> None:
    registry = discover(Policy(disable=frozenset({"boom"})))
    assert registry.record("boom").status is PluginStatus.DISABLED


def test_inline_registration_and_unregistration(kb_registry: Registry, kb_register) -> None:  # type: ignore[no-untyped-def]
    import kb_fake_good

    record = kb_register(kb_fake_good, "good")
    assert record.offers_of(BackendKind.LINEAR) == ("fake-fp32-only",)
    chosen = select(BackendKind.LINEAR, LinearRequest(8, 8, activation_dtype="float32"), CPU,
                    registry=kb_registry)
    assert chosen.name == "fake-fp32-only"
    kb_registry.unregister("good")
    chosen = select(BackendKind.LINEAR, LinearRequest(8, 8, activation_dtype="float32"), CPU,
                    registry=kb_registry)
    assert chosen.name == "torch-unquantized"


def test_plugin_without_api_declaration_is_incompatible(kb_registry: Registry) -> None:
    import types

    module = types.ModuleType("kb_no_api")
    record = kb_registry.register(module, "no_api")
    assert record.status is PluginStatus.INCOMPATIBLE
    assert "KERNELBAY_PLUGIN_API" in record.reason


def test_unknown_hook_name_is_reported(kb_registry: Registry) -> None:
    from kernelbay import hookimpl

    class Typo:
        KERNELBAY_PLUGIN_API = "1.0"

        @hookimpl
        def kernelbay_linear_method(self) -> list[type]:
            return []

    record = kb_registry.register(Typo(), "typo")
    assert record.status is not PluginStatus.LOADED
    assert "kernelbay_linear_method" in record.reason
