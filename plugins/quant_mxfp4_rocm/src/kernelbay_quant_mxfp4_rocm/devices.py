"""Where this plugin's MX kernels belong: ROCm gfx942 (MI300: FP8, no native MX) and gfx950
(MI355: native MX instructions). Torch-free.

The Triton kernels that come next use ``rocm_home`` in ``can_implement``. On CUDA they will be
offered only when forced: a separate, low-priority candidate that accepts there, so it loses
to every other accepting method unless ``KERNELBAY_FORCE_LINEAR`` names it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kernelbay.verdict import Verdict

if TYPE_CHECKING:
    from kernelbay.device import DeviceCapability

__all__ = ["NATIVE_MX_ARCHS", "ROCM_HOME_ARCHS", "home_note", "rocm_home"]

#: ROCm architectures the kernels are written and tuned for.
ROCM_HOME_ARCHS: tuple[str, ...] = ("gfx942", "gfx950")
#: Architectures with native MX (scaled FP4/FP8 MFMA) instructions.
NATIVE_MX_ARCHS: tuple[str, ...] = ("gfx950",)


def rocm_home(device: DeviceCapability) -> Verdict:
    """Accept a ROCm device of a home architecture; else reject naming both sides."""
    return Verdict.all(
        Verdict.check(device.platform == "rocm",
                      f"runs on ROCm {'/'.join(ROCM_HOME_ARCHS)}, device is "
                      f"{device.platform} {device.arch}"),
        Verdict.check(device.arch in ROCM_HOME_ARCHS,
                      f"needs a ROCm architecture in {list(ROCM_HOME_ARCHS)}, device is "
                      f"{device.arch!r}"),
    )


def home_note(device: DeviceCapability) -> str:
    """A trace note for reference methods running on a home device (empty elsewhere)."""
    if device.platform != "rocm" or device.arch not in ROCM_HOME_ARCHS:
        return ""
    native = "native MX" if device.arch in NATIVE_MX_ARCHS else "no native MX"
    return (f"{device.arch} ({native}): the Triton MX kernels are not written yet, using the "
            "reference emulation")
