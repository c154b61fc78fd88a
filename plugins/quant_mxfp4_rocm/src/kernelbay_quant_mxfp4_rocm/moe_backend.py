"""Which MXFP4 MoE method to use: ``KERNELBAY_MXFP4_MOE_BACKEND``, read once when the plugin
loads. Torch-free.

Values: ``auto`` (default: ``mxfp4-moe-triton`` where it accepts, i.e. ROCm gfx942/gfx950
with triton, else ``mxfp4-moe-emulation``), ``triton`` (the Triton MoE; on CUDA this is the
only way it is offered, to verify the kernels) and ``emulation`` (the reference MoE
everywhere). The deprecated name ``KERNELBAY_ROCM_MXFP4_MOE`` is still read when the new one
is unset, with one warning per process. An invalid value raises ``ValueError`` naming the
variable, the value and the valid set.

The choice and where it came from show in both MoE methods' verdicts (``kernelbay explain``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["BACKENDS", "BACKEND_VARIABLE", "DEPRECATED_VARIABLE", "MoEBackendChoice",
           "load_choice", "read_choice", "reset_choice"]

log = logging.getLogger("kernelbay.plugins.quant_mxfp4_rocm")

BACKEND_VARIABLE = "KERNELBAY_MXFP4_MOE_BACKEND"
#: The old name, still read (with a warning) when ``BACKEND_VARIABLE`` is unset.
DEPRECATED_VARIABLE = "KERNELBAY_ROCM_MXFP4_MOE"
BACKENDS: tuple[str, ...] = ("auto", "triton", "emulation")

_state: dict[str, object] = {"choice": None, "warned": False}


@dataclass(frozen=True)
class MoEBackendChoice:
    """The chosen MoE backend and its source (a variable name, or ``default``)."""

    backend: str = "auto"
    source: str = "default"

    def describe(self) -> str:
        """e.g. ``MoE backend 'triton' (from KERNELBAY_MXFP4_MOE_BACKEND)``."""
        return f"MoE backend {self.backend!r} (from {self.source})"


def read_choice(environ: Mapping[str, str] | None = None) -> MoEBackendChoice:
    """Parse the variables (``os.environ`` by default); warn once per process about the
    deprecated name; raise ``ValueError`` on a value outside ``BACKENDS``."""
    env = os.environ if environ is None else environ
    value = env.get(BACKEND_VARIABLE, "").strip()
    source = BACKEND_VARIABLE
    if not value:
        value = env.get(DEPRECATED_VARIABLE, "").strip()
        source = f"{DEPRECATED_VARIABLE}, deprecated"
        if value and not _state["warned"]:
            _state["warned"] = True
            log.warning("%s is deprecated; set %s=%s instead", DEPRECATED_VARIABLE,
                        BACKEND_VARIABLE, value)
    if not value:
        return MoEBackendChoice()
    backend = value.lower()
    if backend not in BACKENDS:
        variable = source.split(",")[0]
        raise ValueError(f"{variable}={value!r} is not a valid MXFP4 MoE backend; valid: "
                         f"{list(BACKENDS)}")
    return MoEBackendChoice(backend, source)


def load_choice() -> MoEBackendChoice:
    """The process's choice: read from ``os.environ`` the first time, then remembered (so
    loading the plugin again neither rereads nor warns again)."""
    choice = _state["choice"]
    if choice is None:
        choice = read_choice()
        _state["choice"] = choice
    assert isinstance(choice, MoEBackendChoice)
    return choice


def reset_choice() -> None:
    """Forget the remembered choice (tests); the deprecation warning stays once per process."""
    _state["choice"] = None
