"""Fixtures: tiny NVFP4 checkpoints written on the fly, and a registry holding only this
plugin."""

from __future__ import annotations

import importlib.metadata as metadata
import os
import sys
from collections.abc import Callable
from typing import Any

import pytest
from kernelbay.plugins import ENTRY_POINT_GROUP, Registry
from kernelbay.policy import Policy
from kernelbay.testing.checkpoints import llama_config, write_checkpoint, write_tiny_llama

# The checkpoint helpers are a plain module next to the tests, importable in any import mode
# (the core's tests put their fake plugins on the path the same way).
sys.path.insert(0, os.path.dirname(__file__))

from nvfp4_checkpoints import modelopt_config_json, quantize_llama

PLUGIN = "quant_nvfp4"


@pytest.fixture
def modelopt_checkpoint(tmp_path: Any) -> Callable[..., str]:
    """Write a tiny ModelOpt checkpoint: ``make(quant, algo_of)`` -> path."""
    src = write_tiny_llama(str(tmp_path / "bf16"), seed=1)
    count = [0]

    def make(quant: dict[str, Any], algo_of: Callable[[str], str | None],
             config_json: bool = True) -> str:
        count[0] += 1
        path = str(tmp_path / f"modelopt{count[0]}")
        config = llama_config()
        if config_json:
            config["quantization_config"] = modelopt_config_json(quant)
        hf_quant = {"producer": {"name": "modelopt", "version": "0.47.0"},
                    "quantization": quant}
        return write_checkpoint(path, config, quantize_llama(src, algo_of),
                                {"hf_quant_config.json": hf_quant})

    return make


@pytest.fixture
def ct_checkpoint(tmp_path: Any) -> Callable[..., str]:
    """Write a tiny compressed-tensors checkpoint: ``make(config, algo_of)`` -> path."""
    src = write_tiny_llama(str(tmp_path / "bf16"), seed=2)

    def make(config: dict[str, Any], algo_of: Callable[[str], str | None]) -> str:
        cfg = llama_config(quantization_config=config)
        return write_checkpoint(str(tmp_path / "ct"), cfg,
                                quantize_llama(src, algo_of, "compressed-tensors"))

    return make


@pytest.fixture
def registry() -> Registry:
    """The core's backends plus this plugin (through its entry point), nothing else."""
    reg = Registry(Policy(plugins=frozenset([PLUGIN])))
    (ep,) = [e for e in metadata.entry_points(group=ENTRY_POINT_GROUP) if e.name == PLUGIN]
    reg.load_entry_point(ep)
    return reg
