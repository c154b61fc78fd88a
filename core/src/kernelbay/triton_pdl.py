# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# (Triton kernels are written in its untyped DSL; the Python helpers are typed.)
"""Programmatic dependent launches for Triton kernels (compute capability 9.0 and newer),
the Triton side of ``cuda_jit``'s ``Kernel.launch(programmatic=True)``. Imports triton:
only kernel modules import this, when a backend is built.

A kernel written for it takes a constexpr ``PDL`` and, when it is true, calls
``grid_wait()`` before it reads or writes global memory (it returns once every kernel this
one depends on has finished and its writes are visible: what comes before it, the launch
and the index arithmetic, overlaps the previous kernel's tail) and ``grid_release()`` where
the next programmatic launch may begin (its blocks then take free SM slots and run up to
their own wait).

``enabled(device)`` says whether to build so (unless ``KERNELBAY_PDL=0``, read per call by
``cuda_jit.programmatic_launch``; an NVIDIA GPU of compute capability 9.0 or newer; not the
interpreter; a Triton with the grid-dependency ops), and ``dependent(device, pdl)`` goes
around the launch: captured into a CUDA graph right after another launch made so, the new
node depends on it programmatically (``cuda_jit.programmatic_dependent``); every other launch
is plain (the kernel's wait then returns at once), and ``depend=False`` keeps it plain in any
case while still recording it as releasing (the split-K sums after their GEMM). With ``PDL``
false the kernels compile exactly as before.
``grid_wait`` / ``grid_release`` are the Triton twins of ``kernelbay/ptx.cuh``'s
``grid_dependency_wait`` / ``grid_dependents_launch`` (the same PTX, ``griddepcontrol``).
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any

import triton

from kernelbay.cuda_jit import programmatic_dependent, programmatic_launch

if TYPE_CHECKING:
    import torch

try:  # Triton 3.3 and newer
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: never built with PDL
    gdc_launch_dependents = gdc_wait = None

__all__ = ["SUPPORTED", "dependent", "enabled", "grid_release", "grid_wait", "launch_options"]

#: Whether this Triton has the grid-dependency ops.
SUPPORTED = gdc_wait is not None


@triton.jit
def grid_wait():
    """Wait until the kernels this one depends on have finished (their writes visible)."""
    gdc_wait()


@triton.jit
def grid_release():
    """Let the next programmatic launch start its blocks (once every block here has called
    this or exited)."""
    gdc_launch_dependents()


def enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` are built with ``PDL`` (waiting and releasing; see the
    module doc for when they become programmatic dependents); ``KERNELBAY_PDL`` is validated
    on every call."""
    if not programmatic_launch():
        return False
    # the interpreter's test, as the kernel modules make it
    interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if not SUPPORTED or device.type != "cuda" or interpreting:
        return False
    import torch

    if torch.version.hip is not None:
        return False
    # the device's compute capability, asked of the driver once per device
    return programmatic_launch(device.index if device.index is not None
                               else torch.cuda.current_device())


def dependent(device: torch.device, pdl: bool, *,
              depend: bool = True) -> contextlib.AbstractContextManager[bool]:
    """The context of one launch of a kernel built with ``PDL=pdl`` on ``device``'s current
    stream (``cuda_jit.programmatic_dependent(stream, depend=depend)`` when ``pdl``); its value
    says whether the launch became a programmatic dependent."""
    if not pdl:
        return contextlib.nullcontext(False)
    import torch

    return programmatic_dependent(torch.cuda.current_stream(device).cuda_stream, depend=depend)


def launch_options(pdl: bool) -> dict[str, Any]:
    """Deprecated (core 0.4.4's launch keyword): no keyword any more, since launches go through
    ``dependent``; kept so that a plugin built against 0.4.4 still launches (plainly)."""
    return {}
