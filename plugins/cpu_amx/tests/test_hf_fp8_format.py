"""The ``hf-fp8`` checkpoint format: recognition, per-layer schemes, tensor names, and a
tiny checkpoint planned and run end to end."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
import torch
from cpu_amx_helpers import KERNEL_FLAGS, write_hf_fp8_llama
from kernelbay import FormatRequest, Policy, Registry, parse_device
from kernelbay.checkpoint.folder import CheckpointFolder
from kernelbay.plan import plan_checkpoint
from kernelbay.requests import UNQUANTIZED
from kernelbay_cpu_amx.hf_fp8_format import HfFp8Format, hf_fp8_excluded

AVX = parse_device("cpu+avx512_bf16")
DEEPSEEK = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
            "weight_block_size": [128, 128]}


def fmt(config: dict[str, object]) -> HfFp8Format:
    return HfFp8Format(FormatRequest.from_config(config))


def test_recognises_the_dialect_and_nothing_else() -> None:
    assert HfFp8Format.can_implement(FormatRequest.from_config(DEEPSEEK), AVX).accepted
    per_tensor = {"quant_method": "fp8", "weight_block_size": None}
    assert HfFp8Format.can_implement(FormatRequest.from_config(per_tensor), AVX).accepted
    for other in (None, {"quant_method": "modelopt", "quant_algo": "FP8"},
                  {"quant_method": "compressed-tensors"}):
        verdict = HfFp8Format.can_implement(FormatRequest.from_config(other), AVX)
        assert not verdict.accepted and not verdict.applicable
        assert "reads quant_method 'fp8'" in verdict.reason


@pytest.mark.parametrize("extra, reason", [
    ({"weight_block_size": [128]}, "weight_block_size must be two positive integers [bn, bk], "
                                   "config has [128]"),
    ({"weight_block_size": [0, 128]}, "config has [0, 128]"),
    ({"activation_scheme": "per_token"}, "needs activation_scheme in ['dynamic', 'static'], "
                                         "config has 'per_token'"),
    ({"scale_fmt": "ue8m0"}, "reads float32 weight scales (scale_fmt 'float'), config has "
                             "scale_fmt 'ue8m0'"),
    ({"expert_dtype": "fp4"}, "reads FP8 experts (expert_dtype 'fp8'), config has 'fp4'"),
    ({"fmt": "e5m2"}, "reads E4M3 weights (fmt 'e4m3'), config has fmt 'e5m2'"),
])
def test_rejects_unsupported_variants(extra: dict[str, object], reason: str) -> None:
    verdict = HfFp8Format.can_implement(FormatRequest.from_config({**DEEPSEEK, **extra}), AVX)
    assert not verdict.accepted and verdict.applicable
    assert reason in verdict.reason


def test_schemes_and_tensor_names() -> None:
    handler = fmt({**DEEPSEEK, "activation_scheme": "static"})
    scheme = handler.scheme_for("model.layers.0.mlp.down_proj")
    assert (scheme.name, scheme.group_shape, scheme.dialect, scheme.activation) == (
        "fp8-block", (128, 128), "hf-fp8", "fp8-static")
    assert fmt(DEEPSEEK).scheme_for("x").activation == "fp8-dynamic"
    assert fmt({"quant_method": "fp8"}).scheme_for("x").name == "fp8"
    assert handler.source_name("a.b", "weight_scale") == "a.b.weight_scale_inv"
    assert handler.source_name("a.b", "input_scale") == "a.b.activation_scale"
    assert handler.source_name("a.b", "weight") == "a.b.weight"
    assert handler.source_name("a.b", "bias") == "a.b.bias"
    value = torch.rand(2, 3)
    assert handler.convert("a.b", "weight_scale", value) is value  # already the multiplier


@pytest.mark.parametrize("module, patterns, excluded", [
    ("lm_head", ["lm_head"], True),
    ("model.layers.1.mlp.down_proj", ["model.layers.1"], True),
    ("model.layers.11.mlp.down_proj", ["model.layers.1"], False),
    ("model.layers.3.self_attn.q_proj", [r"model.layers.*.self_attn"], True),
    ("model.layers.3.mlp.gate_proj", ["mlp.gate"], False),
    ("model.layers.3.mlp.gate", ["mlp.gate"], True),
    ("model.decoder.layers.23.fc1", ["fc1"], True),
    ("model.layers.0.mlp.up_proj", ["model.layers.0.mlp.down_proj"], False),
    ("a(b", ["a(b"], True),   # not a regex: suffix rule only
    ("x", None, False),
])
def test_exclusions_follow_transformers(module: str, patterns: list[str] | None,
                                        excluded: bool) -> None:
    assert hf_fp8_excluded(module, patterns) is excluded
    utils = pytest.importorskip("transformers.quantizers.quantizers_utils")
    if all(_valid_regex(p) for p in patterns or []):
        assert utils.should_convert_module(module, patterns) is (not excluded)


def _valid_regex(pattern: str) -> bool:
    import re

    try:
        re.compile(pattern)
    except re.error:
        return False
    return True


def test_ignored_layers_alias_and_unscaled_layers(tmp_path: Path) -> None:
    handler = fmt({**DEEPSEEK, "ignored_layers": ["model.layers.0.mlp"]})
    assert handler.scheme_for("model.layers.0.mlp.up_proj") is UNQUANTIZED
    path = write_hf_fp8_llama(str(tmp_path), exclude=["model.layers.1.mlp.down_proj"])
    folder = CheckpointFolder(path)
    handler = HfFp8Format(folder.format_request())
    modules = {m.name: m for m in handler.linear_modules(folder.tensors)}
    # No scale tensor: unquantized even though the config lists nothing for it.
    assert handler.scheme_for("lm_head") is UNQUANTIZED
    assert handler.scheme_for("model.layers.1.mlp.down_proj") is UNQUANTIZED
    assert handler.scheme_for("model.layers.0.mlp.down_proj").name == "fp8-block"
    assert (modules["model.layers.0.mlp.down_proj"].in_features,
            modules["model.layers.0.mlp.down_proj"].out_features) == (256, 128)


def test_transposed_exporter_detected_from_the_scale_grid(tmp_path: Path) -> None:
    down = "model.layers.0.mlp.down_proj"   # [N, K] = [128, 256], grid [4, 2] of 32 x 128
    path = write_hf_fp8_llama(str(tmp_path), block=(32, 128), transposed=(down,))
    folder = CheckpointFolder(path)
    handler = HfFp8Format(folder.format_request())
    modules = {m.name: m for m in handler.linear_modules(folder.tensors)}
    assert (modules[down].in_features, modules[down].out_features) == (256, 128)
    assert handler.scheme_for(down).option("weight_layout") == "kn"
    assert handler.scheme_for("model.layers.0.mlp.up_proj").option("weight_layout") is None
    # With square blocks a [K, N] weight and its grid look exactly like an [N, K] one: only
    # the architecture could tell, so the format keeps the Hugging Face convention.
    path = write_hf_fp8_llama(str(tmp_path / "square"), transposed=(down,))
    folder = CheckpointFolder(path)
    handler = HfFp8Format(folder.format_request())
    modules = {m.name: m for m in handler.linear_modules(folder.tensors)}
    assert (modules[down].in_features, modules[down].out_features) == (128, 256)


def test_plan_chooses_this_plugin(tmp_path: Path, registry: Registry) -> None:
    path = write_hf_fp8_llama(str(tmp_path))
    plan = plan_checkpoint(path, registry=registry, device=AVX)
    assert plan.format.chosen == "hf-fp8"
    chosen = {d.module: d.chosen for d in plan.linears}
    assert chosen.pop("lm_head") == "cpu-bf16-avx512"
    assert len(chosen) == 14 and set(chosen.values()) == {"cpu-fp8-avx512"}, chosen
    elsewhere = plan_checkpoint(path, registry=registry, device=parse_device("sm_90"))
    assert {d.chosen for d in elsewhere.linears} == {"torch-fp8-dequant", "torch-unquantized"}


@pytest.mark.cpu_isa(*KERNEL_FLAGS)
@pytest.mark.parametrize("block", [(128, 128), (32, 128), None])
def test_end_to_end_logits_match_the_reference_methods(tmp_path: Path, ext: ModuleType,
                                                       block: tuple[int, int] | None) -> None:
    """The engine on this plugin vs the engine on the core's reference methods (with one
    layer written [K, N] where the blocks make that detectable)."""
    import importlib.metadata as metadata

    from kernelbay.engine.llm import LLM
    from kernelbay.plugins import ENTRY_POINT_GROUP

    down = "model.layers.1.mlp.down_proj"
    plain = write_hf_fp8_llama(str(tmp_path / "plain"), block=block)
    # The core's reference reads [N, K] only; this plugin also reads the [K, N] export.
    mine_path = (write_hf_fp8_llama(str(tmp_path / "kn"), block=block, transposed=(down,))
                 if block == (32, 128) else plain)
    (ep,) = [e for e in metadata.entry_points(group=ENTRY_POINT_GROUP) if e.name == "cpu_amx"]
    results = []
    for path, disable in ((mine_path, frozenset()),
                          (plain, frozenset({"cpu-fp8-avx512", "cpu-bf16-avx512"}))):
        reg = Registry(Policy(plugins=frozenset(["cpu_amx"]), disable=disable))
        reg.load_entry_point(ep)
        llm = LLM(path, device="cpu", dtype="bfloat16", registry=reg, max_model_len=64,
                  max_num_seqs=1, progress=False)
        names = {d.chosen for d in llm.plan.linears}
        results.append((names, llm.logits([1, 5, 9, 200, 3, 77])))
    (mine, ours), (ref_names, theirs) = results
    assert mine == {"cpu-fp8-avx512", "cpu-bf16-avx512"}
    assert ref_names == {"torch-fp8-dequant", "torch-unquantized"}
    # Both run bf16 activations; they differ by where bf16 rounding happens (the reference
    # rounds the dequantized weight w * s to bf16, the kernels keep it exact).
    err = (ours - theirs).abs().max() / theirs.abs().max()
    assert err < 0.03, err.item()
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
