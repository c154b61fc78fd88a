"""kernelbay quantize: writer discovery, refusals, atomic replacement (with an inline writer)."""

from __future__ import annotations

import json
import os
from typing import Any, ClassVar

import pytest
import torch
from kernelbay import ConfigError, Policy, Registry, Verdict, hookimpl
from kernelbay.checkpoint import CheckpointFolder
from kernelbay.cli.quantize_cmd import writer_rows
from kernelbay.layers.unquantized_format import UnquantizedFormat
from kernelbay.quantize import available_writers, quantize_checkpoint
from kernelbay.testing.checkpoints import write_tiny_llama
from safetensors.torch import load_file, save_file


class HalfPrecisionWriter(UnquantizedFormat):
    """Writes every tensor in float16 (a stand-in producer format for these tests)."""

    name: ClassVar[str] = "test-fp16-writer"
    writes: ClassVar[tuple[str, ...]] = ("test-fp16", "test-broken")
    summary: ClassVar[str] = "test writer"

    @classmethod
    def can_implement(cls, request: Any, device: Any) -> Verdict:
        return Verdict.handles(False, "writes only, reads nothing in these tests")

    @classmethod
    def write(cls, source: CheckpointFolder, destination: str, output_format: str, *,
              progress: bool = False) -> None:
        tensors = load_file(os.path.join(source.path, "model.safetensors"))
        save_file({k: v.half() for k, v in tensors.items()},
                  os.path.join(destination, "model.safetensors"))
        if output_format == "test-broken":
            raise RuntimeError("writer failed half-way")
        with open(os.path.join(destination, "config.json"), "w") as f:
            json.dump({**source.config.model_dump(exclude_none=True), "dtype": "float16"}, f)


@pytest.fixture
def registry() -> Registry:
    class Plugin:
        KERNELBAY_PLUGIN_API = "1.0"

        @hookimpl
        def kernelbay_checkpoint_formats(self) -> list[type]:
            return [HalfPrecisionWriter]

    reg = Registry(Policy(plugins=frozenset()))
    reg.register(Plugin(), "writer")
    return reg


@pytest.fixture
def source(tmp_path: Any) -> str:
    path = write_tiny_llama(os.path.join(str(tmp_path), "src"))
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        f.write("{}")
    return path


def test_writers_are_discovered(registry: Registry) -> None:
    writers = available_writers(registry)
    assert list(writers) == ["test-broken", "test-fp16"]
    assert writers["test-fp16"] == (HalfPrecisionWriter, "writer")


def test_list_rows_name_each_format_its_plugin_and_writer(registry: Registry) -> None:
    rows = writer_rows(registry)
    assert [r[:2] for r in rows] == [["test-broken", "writer"], ["test-fp16", "writer"]]
    assert rows[1][3] == "test-fp16-writer: test writer"


def test_writes_and_copies_side_files(registry: Registry, source: str, tmp_path: Any) -> None:
    out = quantize_checkpoint(source, os.path.join(str(tmp_path), "out"), "test-fp16",
                              registry=registry)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert load_file(os.path.join(out, "model.safetensors"))["lm_head.weight"].dtype == (
        torch.float16)


def test_unknown_format_lists_the_installed_ones(registry: Registry, source: str,
                                                 tmp_path: Any) -> None:
    with pytest.raises(ConfigError, match=r"'nvfp5'.*available: \['test-broken', 'test-fp16'\]"):
        quantize_checkpoint(source, os.path.join(str(tmp_path), "o"), "nvfp5",
                            registry=registry)


def test_refuses_to_overwrite_without_force(registry: Registry, source: str,
                                            tmp_path: Any) -> None:
    dest = os.path.join(str(tmp_path), "out")
    os.makedirs(dest)
    with open(os.path.join(dest, "keep.txt"), "w") as f:
        f.write("old")
    with pytest.raises(ConfigError, match="exists; pass --force"):
        quantize_checkpoint(source, dest, "test-fp16", registry=registry)
    assert os.listdir(dest) == ["keep.txt"]
    quantize_checkpoint(source, dest, "test-fp16", registry=registry, force=True)
    assert "keep.txt" not in os.listdir(dest)
    assert sorted(os.listdir(str(tmp_path))) == ["out", "src"]  # nothing left behind


def test_a_failing_writer_leaves_nothing_half_written(registry: Registry, source: str,
                                                      tmp_path: Any) -> None:
    dest = os.path.join(str(tmp_path), "out")
    with pytest.raises(RuntimeError, match="half-way"):
        quantize_checkpoint(source, dest, "test-broken", registry=registry)
    assert sorted(os.listdir(str(tmp_path))) == ["src"]


def test_an_already_quantized_source_is_refused(registry: Registry, source: str,
                                                tmp_path: Any) -> None:
    with open(os.path.join(source, "hf_quant_config.json"), "w") as f:
        json.dump({"quantization": {"quant_algo": "NVFP4"}}, f)
    with pytest.raises(ConfigError, match="already quantized"):
        quantize_checkpoint(source, os.path.join(str(tmp_path), "o"), "test-fp16",
                            registry=registry)
