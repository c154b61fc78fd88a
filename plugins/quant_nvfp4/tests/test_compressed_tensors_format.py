"""The ``compressed-tensors-nvfp4`` format: its own dialect only, targets/ignore, names and
reciprocal global scales, and the plan."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from kernelbay.checkpoint import CheckpointFolder
from kernelbay.device import parse_device
from kernelbay.errors import CheckpointError, ConfigError
from kernelbay.formats import nvfp4_global_scale, quantize_nvfp4
from kernelbay.plan import plan_checkpoint
from kernelbay.plugins import Registry
from kernelbay.requests import UNQUANTIZED, FormatRequest
from kernelbay.testing import load_method
from kernelbay_quant_nvfp4.compressed_tensors_format import CompressedTensorsNvfp4Format
from kernelbay_quant_nvfp4.modelopt_format import ModelOptFormat
from kernelbay_quant_nvfp4.schemes import nvfp4_scheme
from nvfp4_checkpoints import ct_config, modelopt_config_json, modelopt_quant
from safetensors.torch import load_file

CPU = parse_device("cpu")
W4A4 = nvfp4_scheme("compressed-tensors", w4a4=True)
W4A16 = nvfp4_scheme("compressed-tensors", w4a4=False)
Q = "model.layers.0.self_attn.q_proj"


def _fmt(config: dict[str, object]) -> CompressedTensorsNvfp4Format:
    request = FormatRequest.from_config(config)
    verdict = CompressedTensorsNvfp4Format.can_implement(request, CPU)
    assert verdict.accepted, verdict.reason
    return CompressedTensorsNvfp4Format(request)


def _reason(config: dict[str, object]) -> str:
    verdict = CompressedTensorsNvfp4Format.can_implement(FormatRequest.from_config(config), CPU)
    assert not verdict.accepted
    return verdict.reason


def test_recognises_its_dialect_only() -> None:
    ct = FormatRequest.from_config(ct_config())
    assert CompressedTensorsNvfp4Format.can_implement(ct, CPU).accepted
    assert not ModelOptFormat.can_implement(ct, CPU).accepted
    # A ModelOpt config.json with config_groups is ModelOpt's, by quant_method.
    mo = FormatRequest.from_config(modelopt_config_json(modelopt_quant("NVFP4")))
    assert "config_groups" in mo.config
    assert not CompressedTensorsNvfp4Format.can_implement(mo, CPU).accepted
    assert ModelOptFormat.can_implement(mo, CPU).accepted


def test_rejects_other_compressed_tensors_schemes() -> None:
    fp8 = ct_config()
    fp8["format"] = "float-quantized"
    fp8["config_groups"]["group_0"]["format"] = "float-quantized"  # type: ignore[index]
    assert "'float-quantized'" in _reason(fp8)
    wrong = ct_config()
    wrong["config_groups"]["group_0"]["weights"]["group_size"] = 32  # type: ignore[index]
    assert "group_size is 32" in _reason(wrong)
    tensor = ct_config()
    tensor["config_groups"]["group_0"]["weights"]["strategy"] = "tensor"  # type: ignore[index]
    assert "'tensor'" in _reason(tensor)
    assert "config_groups is {}" in _reason({**ct_config(), "config_groups": {}})
    assert "'frozen'" in _reason({**ct_config(), "quantization_status": "frozen"})
    assert "regular expression" in _reason(ct_config(ignore=["re:model.(layers"]))


def test_ignore_and_targets() -> None:
    fmt = _fmt(ct_config(ignore=["lm_head", "re:.*mlp.down_proj$", Q]))
    assert fmt.scheme_for(Q) == UNQUANTIZED
    assert fmt.scheme_for("model.layers.1.mlp.down_proj") == UNQUANTIZED
    assert fmt.scheme_for("model.layers.1.mlp.up_proj") == W4A4
    assert fmt.scheme_for("model.layers.0.self_attn.k_proj") == W4A4
    assert fmt.scheme_for("model.embed_tokens") == UNQUANTIZED
    # re: patterns are anchored at the start (re.match): "mlp" alone matches nothing.
    assert _fmt(ct_config(ignore=["re:mlp"])).scheme_for("model.layers.1.mlp.up_proj") == W4A4
    only_attn = _fmt(ct_config(targets=["re:.*self_attn\\..*"], w4a4=False))
    assert only_attn.scheme_for(Q) == W4A16
    assert only_attn.scheme_for("model.layers.0.mlp.up_proj") == UNQUANTIZED


def test_most_specific_group_wins_and_ties_fail() -> None:
    config = ct_config()
    groups = config["config_groups"]
    groups["group_1"] = {**groups["group_0"], "targets": [Q],  # type: ignore[index]
                         "input_activations": None}
    fmt = _fmt(config)
    assert fmt.scheme_for(Q) == W4A16  # exact name beats the class target
    assert fmt.scheme_for("model.layers.0.self_attn.k_proj") == W4A4
    groups["group_1"]["targets"] = ["Linear"]  # type: ignore[index]
    with pytest.raises(ConfigError, match=r"targeted equally.*group_0.*group_1"):
        _fmt(config).scheme_for(Q)


def test_fused_shards_must_agree() -> None:
    fmt = _fmt(ct_config(ignore=["lm_head", "model.layers.0.self_attn.k_proj"]))
    assert fmt.scheme_for("model.layers.1.self_attn.qkv_proj") == W4A4
    with pytest.raises(ConfigError, match="k_proj: unquantized"):
        fmt.scheme_for("model.layers.0.self_attn.qkv_proj")


def test_names_and_reciprocal_global_scales(ct_checkpoint: Callable[..., str]) -> None:
    path = ct_checkpoint(ct_config(), lambda m: None if m == "lm_head" else "NVFP4")
    fmt = CompressedTensorsNvfp4Format(CheckpointFolder(path).format_request())
    stored = load_file(f"{path}/model.safetensors")
    assert fmt.source_name(Q, "weight") == f"{Q}.weight_packed"
    assert fmt.source_name(Q, "weight_scale") == f"{Q}.weight_scale"
    assert fmt.source_name(Q, "weight_scale_2") == f"{Q}.weight_global_scale"
    assert fmt.source_name(Q, "input_scale") == f"{Q}.input_global_scale"
    assert fmt.source_name(Q, "bias") == f"{Q}.bias"
    g = fmt.convert(Q, "weight_scale_2", stored[f"{Q}.weight_global_scale"])
    assert g.shape == () and g.dtype == torch.float32
    amax = torch.stack([stored[f"model.layers.0.self_attn.{p}_proj.weight_global_scale"]
                        for p in "qkv"])
    assert torch.all(amax == amax[0])  # q/k/v share one global scale, as exported
    # 1/(1/g) is g up to the last bit of the reciprocal.
    torch.testing.assert_close(g, 1.0 / stored[f"{Q}.weight_global_scale"][0], rtol=0, atol=0)
    a = fmt.convert(Q, "input_scale", stored[f"{Q}.input_global_scale"])
    torch.testing.assert_close(a, nvfp4_global_scale(torch.tensor(3.0)), rtol=2e-7, atol=0)
    packed = stored[f"{Q}.weight_packed"]
    assert fmt.convert(Q, "weight", packed) is packed
    with pytest.raises(ValueError, match="one value"):
        fmt.convert(Q, "weight_scale_2", torch.ones(2))


def test_linear_modules_and_plan(ct_checkpoint: Callable[..., str], registry: Registry) -> None:
    path = ct_checkpoint(ct_config(ignore=["lm_head", "re:.*down_proj$"]),
                         lambda m: None if m == "lm_head" or m.endswith("down_proj")
                         else "NVFP4")
    folder = CheckpointFolder(path)
    fmt = CompressedTensorsNvfp4Format(folder.format_request())
    modules = {m.name: m for m in fmt.linear_modules(folder.tensors)}
    assert len(modules) == 15
    assert (modules[Q].in_features, modules[Q].out_features, modules[Q].dtype) == (64, 64, "uint8")
    assert modules["model.layers.0.mlp.down_proj"].dtype == "bfloat16"
    plan = plan_checkpoint(path, registry=registry, device=CPU)
    assert plan.format.chosen == "compressed-tensors-nvfp4"
    chosen = {d.module: d.chosen for d in plan.linears}
    assert chosen["lm_head"] == chosen["model.layers.1.mlp.down_proj"] == "torch-unquantized"
    assert chosen[Q] == chosen["model.layers.1.mlp.up_proj"] == "nvfp4-emulation"


def test_packed_weight_the_config_ignores_fails(ct_checkpoint: Callable[..., str]) -> None:
    path = ct_checkpoint(ct_config(ignore=["lm_head", Q]),
                         lambda m: None if m == "lm_head" else "NVFP4")
    folder = CheckpointFolder(path)
    with pytest.raises(CheckpointError, match=r"weight_packed.*ignored by"):
        CompressedTensorsNvfp4Format(folder.format_request()).linear_modules(folder.tensors)


def test_checkpoint_tensors_load_into_the_emulation(ct_checkpoint: Callable[..., str],
                                                    registry: Registry) -> None:
    """The load path end to end: plan, then each spec read by ``source_name``, converted by
    ``convert``, and the emulation equal to the reference on ModelOpt-convention scales."""
    from kernelbay.formats import dequantize_nvfp4

    path = ct_checkpoint(ct_config(), lambda m: None if m == "lm_head" else "NVFP4")
    plan = plan_checkpoint(path, registry=registry, device=CPU)
    fmt = CompressedTensorsNvfp4Format(CheckpointFolder(path).format_request())
    stored = load_file(f"{path}/model.safetensors")
    decision = next(d for d in plan.linears if d.module == Q)
    assert decision.selection is not None
    method = decision.selection.backend(decision.request)
    layer = load_method(method, {name: fmt.convert(Q, name, stored[fmt.source_name(Q, name)])
                                 for name in method.tensor_specs()})
    g = 1.0 / stored[f"{Q}.weight_global_scale"].reshape(())
    w = dequantize_nvfp4(stored[f"{Q}.weight_packed"], stored[f"{Q}.weight_scale"], g)
    a = 1.0 / stored[f"{Q}.input_global_scale"].reshape(())
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    # W4A4: the activations go through NVFP4 with the (converted) input scale.
    xq = dequantize_nvfp4(*quantize_nvfp4(x, a))
    assert torch.equal(method.apply(layer, x), torch.nn.functional.linear(xq, w).bfloat16())


def test_per_expert_names_map_by_their_last_component(
        ct_checkpoint: Callable[..., str]) -> None:
    """A MoE method names tensors relative to its block; the dialect's names and the
    reciprocal conversion apply to the last component."""
    path = ct_checkpoint(ct_config(), lambda m: None if m == "lm_head" else "NVFP4")
    fmt = CompressedTensorsNvfp4Format(CheckpointFolder(path).format_request())
    block = "model.layers.3.mlp"
    assert (fmt.source_name(block, "experts.5.gate_proj.weight")
            == f"{block}.experts.5.gate_proj.weight_packed")
    assert (fmt.source_name(block, "experts.5.gate_proj.weight_scale_2")
            == f"{block}.experts.5.gate_proj.weight_global_scale")
    assert (fmt.source_name(block, "experts.0.down_proj.input_scale")
            == f"{block}.experts.0.down_proj.input_global_scale")
    assert (fmt.source_name(block, "experts.5.up_proj.weight_scale")
            == f"{block}.experts.5.up_proj.weight_scale")
    stored = torch.tensor([2688.0 / 3.0])
    value = fmt.convert(block, "experts.5.gate_proj.input_scale", stored)
    assert value.shape == () and torch.equal(value, 1.0 / stored[0])
    packed = torch.zeros(4, 8, dtype=torch.uint8)
    assert fmt.convert(block, "experts.5.gate_proj.weight", packed) is packed
    # Routers are never quantized, whatever the groups target.
    assert fmt.scheme_for(f"{block}.gate") == UNQUANTIZED
    assert fmt.scheme_for(f"{block}.experts.5.gate_proj") == W4A4
