"""The ``modelopt`` format: recognition, per-layer schemes, logical shapes, and the plan."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from kernelbay.checkpoint import CheckpointFolder
from kernelbay.device import parse_device
from kernelbay.errors import CheckpointError, ConfigError
from kernelbay.plan import plan_checkpoint
from kernelbay.plugins import Registry
from kernelbay.requests import UNQUANTIZED, FormatRequest
from kernelbay_quant_nvfp4.compressed_tensors_format import CompressedTensorsNvfp4Format
from kernelbay_quant_nvfp4.matching import modelopt_match
from kernelbay_quant_nvfp4.modelopt_format import SUPPORTED_ALGOS, ModelOptFormat
from kernelbay_quant_nvfp4.schemes import FP8_BLOCK_MODELOPT, FP8_MODELOPT, nvfp4_scheme
from nvfp4_checkpoints import modelopt_quant

CPU = parse_device("cpu")
NVFP4 = nvfp4_scheme("modelopt", w4a4=True)
W4A16 = nvfp4_scheme("modelopt", w4a4=False)
Q = "model.layers.0.self_attn.q_proj"
DOWN1 = "model.layers.1.mlp.down_proj"


def _fmt(config: dict[str, Any], extra: dict[str, Any] | None = None) -> ModelOptFormat:
    request = FormatRequest.from_config({"quant_method": "modelopt", **config}, "config.json",
                                        extra)
    verdict = ModelOptFormat.can_implement(request, CPU)
    assert verdict.accepted, verdict.reason
    return ModelOptFormat(request)


def _reason(config: dict[str, Any], extra: dict[str, Any] | None = None) -> str:
    request = FormatRequest.from_config({"quant_method": "modelopt", **config}, "config.json",
                                        extra)
    verdict = ModelOptFormat.can_implement(request, CPU)
    assert not verdict.accepted
    return verdict.reason


def test_recognises_written_checkpoint_and_not_the_other_dialect(
        modelopt_checkpoint: Callable[..., str]) -> None:
    for config_json in (True, False):
        path = modelopt_checkpoint(modelopt_quant("NVFP4"), lambda m: None if m == "lm_head"
                                   else "NVFP4", config_json=config_json)
        request = CheckpointFolder(path).format_request()
        assert request.quant_method == "modelopt"
        assert ModelOptFormat.can_implement(request, CPU).accepted
        # The ModelOpt config.json also carries config_groups: the dialect is the method.
        ct = CompressedTensorsNvfp4Format.can_implement(request, CPU)
        assert not ct.accepted and "'modelopt'" in ct.reason


def test_rejects_other_methods_and_unknown_algos() -> None:
    for method in (None, "compressed-tensors", "quark", "fp8"):
        request = FormatRequest.from_config(None if method is None else
                                            {"quant_method": method, "quant_algo": "NVFP4"})
        assert not ModelOptFormat.can_implement(request, CPU).accepted
    reason = _reason({"quant_algo": "INT4_AWQ"})
    assert "'INT4_AWQ'" in reason and all(a in reason for a in SUPPORTED_ALGOS)
    assert "no quant_algo" in _reason({})
    assert "must agree" in _reason({"quant_algo": "NVFP4"}, {"quant_algo": "FP8"})
    assert "group_size 32" in _reason({"quant_algo": "NVFP4", "group_size": 32})
    assert "quantized_layers" in _reason({"quant_algo": "MIXED_PRECISION"})
    bad_layer = {"quant_algo": "MIXED_PRECISION", "quantized_layers": {Q: {"quant_algo": "W8A8"}}}
    assert "'W8A8'" in _reason(bad_layer) and "FP8_PB_WO" in _reason(bad_layer)
    assert "list of module names" in _reason({"quant_algo": "FP8", "exclude_modules": "lm_head"})


def test_algo_read_from_side_file_and_any_case() -> None:
    fmt = _fmt({}, {"quant_algo": "fp8_pb_wo", "exclude_modules": ["lm_head"]})
    assert fmt.scheme_for(Q) == FP8_BLOCK_MODELOPT
    assert _fmt({"quant_algo": "FP8"}).scheme_for(Q) == FP8_MODELOPT
    assert _fmt({"quant_algo": "W4A16_NVFP4", "group_size": 16}).scheme_for(Q) == W4A16
    assert _fmt({"quant_algo": "NVFP4"}).scheme_for(Q) == NVFP4


def test_match_order_exact_then_prefix_then_wildcard() -> None:
    patterns = ["*q_proj", "model.layers.0", "model.layers.0.self_attn", Q]
    assert modelopt_match(Q, patterns) == Q
    assert modelopt_match(Q, patterns[:3]) == "model.layers.0.self_attn"  # longest prefix
    assert modelopt_match(Q, patterns[:2]) == "model.layers.0"
    assert modelopt_match(Q, patterns[:1]) == "*q_proj"
    # A prefix ends at a dot: model.layers.1 does not cover model.layers.10.
    assert modelopt_match("model.layers.10.mlp.up_proj", ["model.layers.1"]) is None
    assert modelopt_match("model.layers.10.mlp.up_proj", ["model.layers.1*"]) is not None
    assert modelopt_match(Q, []) is None


def test_scheme_for_exclusions_from_both_files() -> None:
    fmt = _fmt({"quant_algo": "NVFP4", "ignore": ["model.layers.0.self_attn*"]},
               {"quant_algo": "NVFP4", "exclude_modules": ["model.layers.1.mlp", "lm_head"]})
    assert fmt.scheme_for(Q) == UNQUANTIZED
    assert fmt.scheme_for(DOWN1) == UNQUANTIZED
    assert fmt.scheme_for("model.layers.1.self_attn.q_proj") == NVFP4
    assert fmt.scheme_for("model.layers.0.mlp.down_proj") == NVFP4
    # lm_head and embeddings stay unquantized even when the config does not exclude them.
    bare = _fmt({"quant_algo": "NVFP4"})
    assert bare.scheme_for("lm_head") == UNQUANTIZED
    assert bare.scheme_for("model.embed_tokens") == UNQUANTIZED
    assert "excluded by 'model.layers.1.mlp'" in fmt.explain(DOWN1)[1]


def test_mixed_precision_layers() -> None:
    fmt = _fmt({"quant_algo": "MIXED_PRECISION", "exclude_modules": ["model.layers.1.mlp.up_proj"],
                "quantized_layers": {
                    "model.layers.0.self_attn": {"quant_algo": "FP8"},
                    Q: {"quant_algo": "NVFP4", "group_size": 16},
                    "model.layers.*.mlp.down_proj": {"quant_algo": "fp8_pb_wo"},
                    "model.layers.1.mlp": {"quant_algo": "W4A16_NVFP4", "group_size": 16},
                }})
    assert fmt.scheme_for(Q) == NVFP4  # exact beats the prefix entry
    assert fmt.scheme_for("model.layers.0.self_attn.k_proj") == FP8_MODELOPT  # prefix
    assert fmt.scheme_for(DOWN1) == W4A16  # prefix beats wildcard
    assert fmt.scheme_for("model.layers.0.mlp.down_proj") == FP8_BLOCK_MODELOPT  # wildcard
    assert fmt.scheme_for("model.layers.0.mlp.gate_proj") == UNQUANTIZED  # unlisted
    assert fmt.scheme_for("model.layers.1.mlp.up_proj") == UNQUANTIZED  # excluded
    assert "not listed" in fmt.explain("model.layers.0.mlp.gate_proj")[1]


def test_fused_shards_must_agree() -> None:
    fmt = _fmt({"quant_algo": "NVFP4", "exclude_modules": ["model.layers.0.self_attn.v_proj"]})
    assert fmt.scheme_for("model.layers.1.self_attn.qkv_proj") == NVFP4
    assert fmt.scheme_for("model.layers.0.mlp.gate_up_proj") == NVFP4
    with pytest.raises(ConfigError, match=r"v_proj: unquantized.*excluded"):
        fmt.scheme_for("model.layers.0.self_attn.qkv_proj")
    # A config entry naming the fused module itself decides directly.
    named = _fmt({"quant_algo": "NVFP4", "exclude_modules": ["model.layers.0.self_attn.qkv_proj",
                                                             "model.layers.0.self_attn.v_proj"]})
    assert named.scheme_for("model.layers.0.self_attn.qkv_proj") == UNQUANTIZED


def test_linear_modules_report_logical_shapes(modelopt_checkpoint: Callable[..., str]) -> None:
    mixed = {Q: {"quant_algo": "NVFP4", "group_size": 16},
             "model.layers.0.mlp.down_proj": {"quant_algo": "FP8"},
             "model.layers.1.mlp.down_proj": {"quant_algo": "FP8_PB_WO"}}
    path = modelopt_checkpoint(modelopt_quant("MIXED_PRECISION", quantized_layers=mixed),
                               lambda m: mixed.get(m, {}).get("quant_algo"))
    folder = CheckpointFolder(path)
    fmt = ModelOptFormat(folder.format_request())
    modules = {m.name: m for m in fmt.linear_modules(folder.tensors)}
    assert (modules[Q].in_features, modules[Q].out_features, modules[Q].dtype) == (64, 64, "uint8")
    assert modules["model.layers.0.mlp.down_proj"].in_features == 128
    assert modules["model.layers.1.mlp.down_proj"].in_features == 128
    assert modules["lm_head"].in_features == 64 and "model.embed_tokens" not in modules


def test_linear_modules_fail_loudly_on_mismatch(modelopt_checkpoint: Callable[..., str]) -> None:
    # The config excludes q_proj, but its weight is packed NVFP4.
    path = modelopt_checkpoint(modelopt_quant("NVFP4", exclude=["lm_head", Q]),
                               lambda m: None if m == "lm_head" else "NVFP4")
    folder = CheckpointFolder(path)
    with pytest.raises(CheckpointError, match=r"q_proj.weight.*uint8.*unquantized.*excluded"):
        ModelOptFormat(folder.format_request()).linear_modules(folder.tensors)
    # The config quantizes lm_head-less layers as FP8_PB_WO, but the file holds NVFP4.
    path = modelopt_checkpoint(modelopt_quant("FP8_PB_WO"),
                               lambda m: None if m == "lm_head" else "NVFP4")
    folder = CheckpointFolder(path)
    with pytest.raises(CheckpointError, match=r"uint8.*expected float8_e4m3fn"):
        ModelOptFormat(folder.format_request()).linear_modules(folder.tensors)


def test_plan_chooses_emulation_for_nvfp4_and_torch_for_lm_head(
        modelopt_checkpoint: Callable[..., str], registry: Registry) -> None:
    path = modelopt_checkpoint(modelopt_quant("NVFP4"),
                               lambda m: None if m == "lm_head" else "NVFP4")
    plan = plan_checkpoint(path, registry=registry, device=CPU)
    assert plan.format.chosen == "modelopt"
    chosen = {d.module: d.chosen for d in plan.linears}
    assert chosen.pop("lm_head") == "torch-unquantized"
    assert len(chosen) == 14 and set(chosen.values()) == {"nvfp4-emulation"}, chosen
    q = next(d for d in plan.linears if d.module == Q)
    assert (q.request.in_features, q.request.out_features) == (64, 64)  # type: ignore[union-attr]
    # Under TP 2 the same checkpoint still plans: column/row shards keep K % 16 == 0.
    plan2 = plan_checkpoint(path, registry=registry, device=CPU, tp_size=2)
    assert {d.chosen for d in plan2.linears if d.module != "lm_head"} == {"nvfp4-emulation"}
