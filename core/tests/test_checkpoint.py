"""Reading checkpoints: typed configs, safetensors headers, and one clear error per bad input."""

from __future__ import annotations

import json
import os
import struct

import pytest
from kernelbay import CheckpointError
from kernelbay.checkpoint import CheckpointFolder, ModelConfig, read_safetensors_header
from kernelbay.checkpoint.config import load_json_model
from kernelbay.testing.checkpoints import write_tiny_llama


@pytest.fixture
def tiny(tmp_path: object) -> str:
    return write_tiny_llama(os.path.join(str(tmp_path), "tiny"))


def test_reads_config_both_spellings(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "c.json")
    with open(path, "w") as f:
        json.dump({"torch_dtype": "bfloat16", "rope_theta": 500000.0, "custom": 1,
                   "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, f)
    old = load_json_model(path, ModelConfig)
    with open(path, "w") as f:
        json.dump({"dtype": "bfloat16", "custom": 1,
                   "rope_parameters": {"rope_type": "llama3", "factor": 8.0,
                                       "rope_theta": 500000.0}}, f)
    new = load_json_model(path, ModelConfig)
    for config in (old, new):
        assert config.dtype_name == "bfloat16"
        assert config.rope_theta_value == 500000.0
        assert config.rope_scaling_dict is not None
        assert config.rope_scaling_dict["factor"] == 8.0
        assert config.model_extra == {"custom": 1} or "custom" in (config.model_extra or {})


@pytest.mark.parametrize("content, field", [
    ({"hidden_size": -4}, "hidden_size"),
    ({"dtype": "int3"}, "dtype"),
    ({"num_attention_heads": "many"}, "num_attention_heads"),
])
def test_invalid_config_field_names_file_and_field(tmp_path: object, content: dict[str, object],
                                                   field: str) -> None:
    path = os.path.join(str(tmp_path), "config.json")
    with open(path, "w") as f:
        json.dump(content, f)
    with pytest.raises(CheckpointError) as info:
        load_json_model(path, ModelConfig)
    assert info.value.path == path and info.value.field == field


def test_malformed_json_names_the_file(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "config.json")
    with open(path, "w") as f:
        f.write("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json: is not readable JSON"):
        load_json_model(path, ModelConfig)


def test_headers_are_read_without_data(tiny: str) -> None:
    tensors = CheckpointFolder(tiny).tensors
    info = tensors["model.layers.0.self_attn.q_proj.weight"]
    assert info.shape == (64, 64) and info.dtype == "bfloat16"
    assert info.end - info.start == 64 * 64 * 2


def test_truncated_safetensors_is_reported(tiny: str) -> None:
    path = os.path.join(tiny, "model.safetensors")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 10)
    with pytest.raises(CheckpointError, match="truncated"):
        read_safetensors_header(path)


def test_garbage_header_is_reported(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "x.safetensors")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", 4) + b"nope")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        read_safetensors_header(path)
    with open(path, "wb") as f:
        f.write(b"abc")
    with pytest.raises(CheckpointError, match="too short"):
        read_safetensors_header(path)


def _write_index(folder: str, weight_map: dict[str, str]) -> str:
    path = os.path.join(folder, "model.safetensors.index.json")
    with open(path, "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return path


def test_index_pointing_outside_the_folder_is_refused(tiny: str) -> None:
    _write_index(tiny, {"lm_head.weight": "../elsewhere/model.safetensors"})
    with pytest.raises(CheckpointError) as info:
        _ = CheckpointFolder(tiny).tensors
    assert "outside the checkpoint folder" in str(info.value)
    assert info.value.path.endswith("model.safetensors.index.json")


def test_index_naming_a_missing_shard_or_tensor(tiny: str) -> None:
    _write_index(tiny, {"lm_head.weight": "model-00002.safetensors"})
    with pytest.raises(CheckpointError, match="does not exist"):
        _ = CheckpointFolder(tiny).tensors
    _write_index(tiny, {"not.a.tensor": "model.safetensors"})
    with pytest.raises(CheckpointError) as info:
        _ = CheckpointFolder(tiny).tensors
    assert info.value.tensor == "not.a.tensor"


def test_not_a_folder(tmp_path: object) -> None:
    with pytest.raises(CheckpointError, match="not a checkpoint folder"):
        CheckpointFolder(os.path.join(str(tmp_path), "missing"))


def test_quantization_config_sources(tiny: str) -> None:
    assert CheckpointFolder(tiny).format_request().quant_method is None
    with open(os.path.join(tiny, "hf_quant_config.json"), "w") as f:
        json.dump({"producer": {"name": "modelopt"},
                   "quantization": {"quant_algo": "NVFP4", "group_size": 16}}, f)
    request = CheckpointFolder(tiny).format_request()
    assert request.quant_method == "modelopt"
    assert request.config["quant_algo"] == "NVFP4"
    assert request.source.endswith("hf_quant_config.json")
