"""Bad checkpoints: each produces one clear error naming the file and tensor or field."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from engine_helpers import save_tiny
from kernelbay import CheckpointError, ConfigError, Policy, Registry
from kernelbay.engine import LLM
from safetensors.torch import load_file, save_file

CORE_ONLY = Registry(Policy(plugins=frozenset()))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny(str(tmp_path_factory.mktemp("pristine")), "llama")


@pytest.fixture
def model(pristine: str, tmp_path: object) -> str:
    path = os.path.join(str(tmp_path), "m")
    shutil.copytree(pristine, path)
    return path


def _edit_tensors(path: str, edit: object) -> str:
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)  # type: ignore[operator]
    save_file(tensors, file)
    return file


def _edit_config(path: str, **changes: object) -> None:
    file = os.path.join(path, "config.json")
    with open(file) as f:
        config = json.load(f)
    config.update(changes)
    with open(file, "w") as f:
        json.dump(config, f)


def test_unsupported_architecture(model: str) -> None:
    _edit_config(model, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ConfigError, match=r"'GPT2LMHeadModel'.*supported: \['Deepseek"):
        LLM(model, registry=CORE_ONLY)


def test_missing_tensor(model: str) -> None:
    _edit_tensors(model, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError) as info:
        LLM(model, registry=CORE_ONLY)
    assert info.value.tensor == "model.layers.1.mlp.up_proj.weight"


def test_missing_norm_tensor(model: str) -> None:
    _edit_tensors(model, lambda t: t.pop("model.norm.weight"))
    with pytest.raises(CheckpointError) as info:
        LLM(model, registry=CORE_ONLY)
    assert info.value.tensor == "model.norm.weight"


def test_unexpected_tensor(model: str) -> None:
    file = _edit_tensors(model, lambda t: t.__setitem__("model.layers.0.mlp.extra.weight",
                                                        torch.zeros(3)))
    with pytest.raises(CheckpointError) as info:
        LLM(model, registry=CORE_ONLY)
    assert info.value.tensor == "model.layers.0.mlp.extra.weight" and info.value.path == file


def test_wrong_shape(model: str) -> None:
    name = "model.layers.0.input_layernorm.weight"
    file = _edit_tensors(model, lambda t: t.__setitem__(name, torch.ones(65)))
    with pytest.raises(CheckpointError) as info:
        LLM(model, registry=CORE_ONLY)
    assert info.value.tensor == name and info.value.path == file
    assert "[65]" in str(info.value) and "[64]" in str(info.value)


def test_wrong_linear_shape(model: str) -> None:
    name = "model.layers.0.self_attn.o_proj.weight"
    _edit_tensors(model, lambda t: t.__setitem__(name, torch.zeros(64, 60)))
    with pytest.raises(CheckpointError) as info:
        LLM(model, registry=CORE_ONLY)
    assert info.value.tensor == name and "[64, 60]" in str(info.value)


def test_wrong_dtype(model: str) -> None:
    name = "model.layers.0.mlp.down_proj.weight"
    _edit_tensors(model, lambda t: t.__setitem__(name, torch.zeros(64, 96, dtype=torch.int32)))
    with pytest.raises(CheckpointError) as info:
        LLM(model, registry=CORE_ONLY)
    assert info.value.tensor == name and "int32" in str(info.value)


def test_truncated_file(model: str) -> None:
    file = os.path.join(model, "model.safetensors")
    with open(file, "r+b") as f:
        f.truncate(os.path.getsize(file) // 2)
    with pytest.raises(CheckpointError, match="truncated") as info:
        LLM(model, registry=CORE_ONLY)
    assert info.value.path == file


def test_index_outside_the_folder(model: str) -> None:
    with open(os.path.join(model, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {"model.norm.weight": "../../etc/model.safetensors"}}, f)
    with pytest.raises(CheckpointError, match="outside the checkpoint folder"):
        LLM(model, registry=CORE_ONLY)


def test_malformed_config(model: str) -> None:
    _edit_config(model, num_attention_heads="four")
    with pytest.raises(CheckpointError) as info:
        LLM(model, registry=CORE_ONLY)
    assert info.value.field == "num_attention_heads"
    assert info.value.path.endswith("config.json")


def test_sharded_index_loads(model: str) -> None:
    tensors = load_file(os.path.join(model, "model.safetensors"))
    os.remove(os.path.join(model, "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, part in shards.items():
        save_file({n: tensors[n] for n in part}, os.path.join(model, shard))
        weight_map.update(dict.fromkeys(part, shard))
    with open(os.path.join(model, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    llm = LLM(model, dtype="float32", registry=CORE_ONLY)
    assert llm.logits([1, 2, 3]).shape == (3, 160)


def test_optional_tensor_absent_from_the_checkpoint(pristine: str) -> None:
    from kernelbay import hookimpl
    from kernelbay.layers import TensorSpec
    from kernelbay.layers.torch_linear import TorchUnquantizedLinear

    class WithOptionalScale(TorchUnquantizedLinear):
        """Reads an optional per-layer scale; without one the layer is plain."""

        name = "test-optional-scale"
        priority = 50

        def tensor_specs(self):  # type: ignore[no-untyped-def]
            return {**super().tensor_specs(), "extra_scale": TensorSpec((), "float32",
                                                                          required=False)}

    class Plugin:
        KERNELBAY_PLUGIN_API = "1.0"

        @hookimpl
        def kernelbay_linear_methods(self) -> list[type]:
            return [WithOptionalScale]

    registry = Registry(Policy(plugins=frozenset()))
    registry.register(Plugin(), "optional")
    llm = LLM(pristine, dtype="float32", registry=registry)
    layer = llm.model.model.layers[0].self_attn.q_proj
    assert layer.method.name == "test-optional-scale"
    assert getattr(layer, "extra_scale", None) is None
    plain = LLM(pristine, dtype="float32", registry=CORE_ONLY)
    assert torch.equal(llm.logits([1, 2, 3]), plain.logits([1, 2, 3]))
