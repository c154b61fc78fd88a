"""``kernelbay quantize --format fp8``: the written Hugging Face fine-grained FP8 checkpoint
(layout, config, tensors against the one reference), what transformers makes of it, and the
bundled demo quantized, planned, scored and run end to end through this plugin."""

from __future__ import annotations

import importlib.metadata as metadata
import json
import os
from pathlib import Path

import pytest
import torch
from cpu_amx_helpers import KERNEL_FLAGS
from kernelbay import Policy, Registry
from kernelbay.checkpoint.folder import CheckpointFolder
from kernelbay.checkpoint.layout import plain_linear_modules
from kernelbay.demo import demo_path, heldout_text
from kernelbay.formats.fp8 import dequantize_fp8_per_block, quantize_fp8_per_block
from kernelbay.plugins import ENTRY_POINT_GROUP
from kernelbay.quantize import available_writers, quantize_checkpoint
from kernelbay.requests import UNQUANTIZED
from kernelbay_cpu_amx import hf_fp8_writer
from kernelbay_cpu_amx.hf_fp8_format import HfFp8Format
from safetensors import safe_open
from safetensors.torch import load_file

ROUTERS = [f"model.layers.{i}.mlp.gate" for i in (1, 2, 3)]
#: Held-out bits per byte of the demo on the first 16 KB of its held-out sample, measured
#: with kernelbay.LLM on this CPU: bf16 1.3446, this FP8 checkpoint 1.3463 (+0.13%).
BPB_BOUND = 0.01


def core_and_cpu_amx(disable: frozenset[str] = frozenset()) -> Registry:
    reg = Registry(Policy(plugins=frozenset(["cpu_amx"]), disable=disable))
    (ep,) = [e for e in metadata.entry_points(group=ENTRY_POINT_GROUP) if e.name == "cpu_amx"]
    reg.load_entry_point(ep)
    return reg


@pytest.fixture(scope="module")
def fp8_demo(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The bundled demo written by this plugin's writer."""
    target = tmp_path_factory.mktemp("writer") / "demo-fp8"
    return quantize_checkpoint(demo_path(), str(target), "fp8", registry=core_and_cpu_amx())


def test_the_writer_is_offered_as_fp8() -> None:
    assert available_writers(core_and_cpu_amx())["fp8"] == (HfFp8Format, "cpu_amx")
    with pytest.raises(ValueError, match=r"hf-fp8 writes \['fp8'\], asked for 'fp8-e5m2'"):
        HfFp8Format.write(CheckpointFolder(demo_path()), "/nonexistent", "fp8-e5m2")


def test_layout_is_the_fine_grained_fp8_dialect(fp8_demo: str) -> None:
    assert sorted(os.listdir(fp8_demo)) == ["config.json", "generation_config.json",
                                            "model.safetensors", "tokenizer.json"]
    with open(os.path.join(demo_path(), "config.json"), encoding="utf-8") as f:
        source_config = json.load(f)
    with open(os.path.join(fp8_demo, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    assert config.pop("quantization_config") == {
        "activation_scheme": "dynamic", "fmt": "e4m3",
        "modules_to_not_convert": ["lm_head", *ROUTERS], "quant_method": "fp8",
        "weight_block_size": [128, 128]}
    assert config == source_config
    with safe_open(os.path.join(fp8_demo, "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    source = load_file(os.path.join(demo_path(), "model.safetensors"))
    written = load_file(os.path.join(fp8_demo, "model.safetensors"))
    folder = CheckpointFolder(demo_path())
    linears = {m.name for m in plain_linear_modules(folder.tensors)}
    quantized = linears - {"lm_head", *ROUTERS}
    assert "model.layers.3.mlp.experts.7.down_proj" in quantized
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa" in quantized
    assert len(quantized) == 4 * 5 + 3 + 3 * (8 * 3 + 3)
    assert set(written) == set(source) | {f"{m}.weight_scale_inv" for m in quantized}
    for name, value in source.items():
        module = name.removesuffix(".weight")
        if module not in quantized:
            assert written[name].dtype == value.dtype and torch.equal(written[name], value), name
            continue
        q, scale = written[name], written[f"{module}.weight_scale_inv"]
        n, k = value.shape
        assert q.dtype == torch.float8_e4m3fn and tuple(q.shape) == (n, k)
        assert scale.dtype == torch.float32
        assert tuple(scale.shape) == (-(-n // 128), -(-k // 128))
        want_q, want_scale = quantize_fp8_per_block(value, (128, 128))
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)), name
        assert torch.equal(scale, want_scale), name


def test_the_format_reads_what_the_writer_wrote(fp8_demo: str) -> None:
    folder = CheckpointFolder(fp8_demo)
    handler = HfFp8Format(folder.format_request())
    handler.linear_modules(folder.tensors)
    assert handler.scheme_for("lm_head") is UNQUANTIZED
    assert handler.scheme_for(ROUTERS[0]) is UNQUANTIZED
    scheme = handler.scheme_for("model.layers.2.mlp.experts.4.up_proj")
    assert (scheme.name, scheme.group_shape, scheme.activation) == ("fp8-block", (128, 128),
                                                                     "fp8-dynamic")
    # Expert tensors are named relative to the MoE block; only the leaf is renamed.
    assert handler.source_name("model.layers.2.mlp", "experts.4.up_proj.weight_scale") == (
        "model.layers.2.mlp.experts.4.up_proj.weight_scale_inv")


def test_large_checkpoints_are_sharded_as_save_pretrained_does(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hf_fp8_writer, "MAX_SHARD_BYTES", 1_500_000)
    path = quantize_checkpoint(demo_path(), str(tmp_path / "sharded"), "fp8",
                               registry=core_and_cpu_amx())
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    assert len(files) >= 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    with open(os.path.join(path, "model.safetensors.index.json"), encoding="utf-8") as f:
        index = json.load(f)
    stored = {}
    for file in files:
        with safe_open(os.path.join(path, file), framework="pt") as handle:
            stored.update(dict.fromkeys(handle.keys(), file))
    assert index["weight_map"] == stored
    # A weight and its scales land in one shard.
    for name, file in stored.items():
        if name.endswith(".weight_scale_inv"):
            assert stored[name.removesuffix("_scale_inv")] == file
    whole = load_file(os.path.join(path, files[0]))
    assert whole  # each shard is a readable safetensors file
    assert len(stored) == len(CheckpointFolder(path).tensors)


def test_transformers_dequantizes_it_to_our_weights(fp8_demo: str) -> None:
    """transformers (no GPU here) loads the checkpoint by dequantizing it to bf16
    (``Fp8Dequantize``): its weights equal ``kernelbay.formats.fp8``'s dequantization of
    ours, except where its CPU path infers the block from the grid (rows // grid rows) and so
    misplaces a partial edge tile: q_b_proj, [192, 128] = one 128-row block plus 64 rows, is
    read as two 96-row blocks. (Its GPU kernels use weight_block_size and agree.)"""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers loads FP8 checkpoints only with "
                                             "accelerate installed")
    if torch.cuda.is_available():
        pytest.skip("with a GPU transformers keeps FP8 modules instead of dequantizing")
    model = transformers.AutoModelForCausalLM.from_pretrained(fp8_demo, device_map="cpu")
    params = dict(model.named_parameters())
    written = load_file(os.path.join(fp8_demo, "model.safetensors"))
    grid_misread = []
    compared = 0
    for name, scale in written.items():
        if not name.endswith(".weight_scale_inv"):
            continue
        module = name.removesuffix(".weight_scale_inv")
        ours = dequantize_fp8_per_block(written[f"{module}.weight"], scale, (128, 128),
                                        torch.bfloat16)
        if ".experts." in module:  # transformers 5 fuses experts: gate_up_proj [E, 2I, H]
            block, rest = module.split(".experts.")
            expert, proj = rest.split(".")
            if proj == "down_proj":
                theirs = params[f"{block}.experts.down_proj"][int(expert)]
            else:
                gate_up = params[f"{block}.experts.gate_up_proj"][int(expert)]
                half = gate_up.shape[0] // 2
                theirs = gate_up[:half] if proj == "gate_proj" else gate_up[half:]
        else:
            theirs = params[f"{module}.weight"]
        n, k = ours.shape
        if any(size % 128 and size > 128 for size in (n, k)):  # partial tile after whole ones
            grid_misread.append(module)
            assert not torch.equal(theirs, ours), module  # the misread shows
            continue
        assert torch.equal(theirs, ours), module
        compared += 1
    assert grid_misread == [f"model.layers.{i}.self_attn.q_b_proj" for i in range(4)]
    assert compared == 4 * 4 + 3 + 3 * 27
    assert torch.equal(params["lm_head.weight"], written["lm_head.weight"])
    assert torch.equal(params[f"{ROUTERS[0]}.weight"], written[f"{ROUTERS[0]}.weight"].float())


@pytest.mark.cpu_isa(*KERNEL_FLAGS)
def test_the_demo_in_fp8_runs_on_this_plugin(fp8_demo: str) -> None:
    from kernelbay.demo.evaluate import bits_per_byte
    from kernelbay.engine import LLM

    registry = core_and_cpu_amx()
    llm = LLM(fp8_demo, device="cpu", registry=registry, progress=False)
    chosen = {d.module: d.chosen for d in llm.plan.linears}
    assert llm.plan.format.chosen == "hf-fp8"
    for i in range(4):
        attn = f"model.layers.{i}.self_attn"
        # N=80 and K=64 (not a whole 128 block) do not suit the kernels: the core's reference.
        assert chosen.pop(f"{attn}.kv_a_proj_with_mqa") == "torch-fp8-dequant"
        assert chosen.pop(f"{attn}.kv_b_proj") == "torch-fp8-dequant"
    assert chosen.pop("lm_head") == "cpu-bf16-avx512"
    experts = {m: chosen.pop(m) for m in list(chosen) if m.endswith(".experts")}
    assert experts == {f"model.layers.{i}.mlp.experts": "cpu-fp8-moe" for i in (1, 2, 3)}
    assert set(chosen.values()) == {"cpu-fp8-avx512"} and len(chosen) == 4 * 3 + 3 + 9
    text = heldout_text()[:16384]
    fp8 = bits_per_byte(llm.logits, text)
    bf16 = bits_per_byte(LLM(demo_path(), device="cpu", registry=registry,
                             progress=False).logits, text)
    assert abs(fp8 - bf16) <= BPB_BOUND * bf16, (fp8, bf16)


@pytest.mark.cpu_isa(*KERNEL_FLAGS)
def test_kernelbay_run_quantize_fp8(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    from kernelbay.cli import main

    for name in list(os.environ):
        if name.startswith("KERNELBAY_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("KERNELBAY_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KERNELBAY_PLUGINS", "cpu_amx")
    assert main(["run", "--quantize", "fp8", "--max-tokens", "32"]) == 0
    out = capsys.readouterr().out
    assert 'def read_config(path):\n    """' in out and "[32 tokens" in out
    assert "checkpoint format: hf-fp8" in out and "cpu-fp8-moe x3" in out
    (cached,) = os.listdir(tmp_path / "quantized")
    assert main(["explain", str(tmp_path / "quantized" / cached)]) == 0
    plan = capsys.readouterr().out
    (experts,) = [line for line in plan.splitlines() if "mlp.experts" in line]
    assert "cpu-fp8-moe" in experts, experts
