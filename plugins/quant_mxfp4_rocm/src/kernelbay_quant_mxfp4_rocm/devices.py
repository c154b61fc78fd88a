"""Where this plugin's MX kernels belong: ROCm gfx942 (MI300: FP8, no native MX) and gfx950
(MI355: native MX instructions). Torch-free.

The Triton methods use ``rocm_home`` in ``can_implement``. On CUDA the same kernels are
offered only when forced: a separate, lowest-priority candidate (``mxfp4-triton-cuda``) that
accepts there, so it loses to every other accepting method unless ``KERNELBAY_FORCE_LINEAR``
names it (forcing a candidate that rejects raises, so the CUDA candidate must accept).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kernelbay.verdict import Verdict

if TYPE_CHECKING:
    from kernelbay.device import DeviceCapability

__all__ = ["NATIVE_MX_ARCHS", "ROCM_HOME_ARCHS", "home_note", "rocm_home", "triton_present"]

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


def triton_present() -> Verdict:
    """Accept when the ``triton`` package is importable (checked without importing it)."""
    import importlib.util

    return Verdict.check(importlib.util.find_spec("triton") is not None,
                         "needs the triton package, which is not installed "
                         "(pip install triton)")


def native_note(device: DeviceCapability) -> str:
    """Whether the architecture has native MX instructions, for trace notes."""
    if device.arch in NATIVE_MX_ARCHS:
        return (f"{device.arch} has native MX (scaled FP4/FP8 MFMA); this kernel still "
                "dequantizes in registers to bf16 MFMA")
    return f"{device.arch}: no native MX, weights dequantized in registers to bf16 MFMA"


def home_note(device: DeviceCapability) -> str:
    """A trace note for reference methods running on a home device (empty elsewhere)."""
    if device.platform != "rocm" or device.arch not in ROCM_HOME_ARCHS:
        return ""
    native = "native MX" if device.arch in NATIVE_MX_ARCHS else "no native MX"
    return (f"{device.arch} ({native}): the reference emulation; the Triton methods are "
            "preferred where they accept")
