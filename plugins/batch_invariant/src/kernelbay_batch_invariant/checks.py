"""The capability check every backend of this plugin shares (no torch, no triton: discovery
imports the backends' modules)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kernelbay.verdict import Verdict

if TYPE_CHECKING:
    from kernelbay.device import DeviceCapability

__all__ = ["runs_on_cuda"]


def runs_on_cuda(device: DeviceCapability) -> Verdict:
    """Accepts CUDA devices (the kernels are Triton on CUDA); the rejection names the
    platform."""
    return Verdict.check(device.platform == "cuda",
                         f"runs Triton on CUDA devices, device platform is {device.platform!r}")
