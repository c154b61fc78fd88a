"""Checks shared by this plugin's collectives: transport, platform, world size, peer
access, symmetric memory and the multicast switches of the environment."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from kernelbay.verdict import Verdict

if TYPE_CHECKING:
    from kernelbay.device import DeviceCapability
    from kernelbay.requests import CollectiveRequest

__all__ = [
    "MAX_WORLD",
    "MIN_WORLD",
    "multicast_switched_off",
    "peer_checks",
    "symm_mem_importable",
]

MIN_WORLD = 2
MAX_WORLD = 8

#: Environment switches that turn multicast (NVLS) off, with the value that does it. A
#: host that sets any of them has multicast off for this plugin, whatever the device says.
MULTICAST_SWITCHES = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                      "NVSHMEM_DISABLE_NVLS": "1"}


def multicast_switched_off(environ: Mapping[str, str] | None = None) -> list[str]:
    """The ``NAME=value`` switches of ``environ`` (default: the process environment) that
    turn multicast off; empty when none does."""
    env = os.environ if environ is None else environ
    return [f"{name}={env[name]}" for name, off in MULTICAST_SWITCHES.items()
            if env.get(name, "").strip() == off]


def symm_mem_importable() -> bool:
    """True when this torch ships ``torch.distributed._symmetric_memory``."""
    try:
        return importlib.util.find_spec("torch.distributed._symmetric_memory") is not None
    except (ImportError, ValueError):
        return False


def peer_checks(request: CollectiveRequest, device: DeviceCapability) -> list[Verdict]:
    """Rejections shared by every symmetric-memory collective, with the numbers found."""
    return [
        Verdict.check(request.transport == "nccl",
                      f"needs the nccl transport, request asks {request.transport!r}"),
        Verdict.check(device.platform == "cuda",
                      f"needs a CUDA device, device is {device.platform!r}"),
        Verdict.check(MIN_WORLD <= request.world_size <= MAX_WORLD,
                      f"needs {MIN_WORLD}..{MAX_WORLD} ranks, request has "
                      f"{request.world_size}"),
        Verdict.check(device.device_count >= request.world_size,
                      f"needs {request.world_size} devices on this host, device has "
                      f"{device.device_count}"),
        Verdict.check(device.p2p is True,
                      "needs peer-to-peer access between the devices, device "
                      f"{device.arch!r} reports p2p={device.p2p}"),
        Verdict.check(symm_mem_importable(),
                      "needs torch.distributed._symmetric_memory, this torch has none"),
    ]
