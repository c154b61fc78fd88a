"""Which device facts the engine decides with: the one the model runs on."""

from __future__ import annotations

import pytest
from engine_helpers import save_tiny
from kernelbay import ConfigError, Policy, Registry
from kernelbay.device import DeviceCapability, parse_device
from kernelbay.engine import LLM


def test_cpu_model_on_a_gpu_host_decides_for_the_cpu(tmp_path: object) -> None:
    path = save_tiny(str(tmp_path), "llama")
    registry = Registry(Policy(plugins=frozenset()))
    # what the registry would probe on a GPU host: the default accelerator
    registry._device = DeviceCapability(platform="cuda", arch="sm_90", compute_capability=(9, 0))
    llm = LLM(path, device="cpu", registry=registry)
    assert llm.capability.platform == "cpu"
    assert llm.capability.source == "probed"


def test_a_described_gpu_still_refuses_a_cpu_run(tmp_path: object) -> None:
    path = save_tiny(str(tmp_path), "llama")
    registry = Registry(Policy(plugins=frozenset(), device="sm_90"))
    assert registry.device() == parse_device("sm_90")
    with pytest.raises(ConfigError, match=r"describes device .cuda sm_90.*runs on cpu"):
        LLM(path, device="cpu", registry=registry)
