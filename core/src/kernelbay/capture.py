"""Whether a CUDA graph is being captured, for code that has an eager way and a capturable way.

Inside a capture nothing may read a device value on the host (``item``, ``tolist``, a
data-dependent shape such as ``unique`` or ``nonzero``) or copy from pageable host memory: the
capture fails. A layer with such an eager fast path (the MoE routing reads which experts are
used) asks ``is_capturing`` and takes its capturable path instead. ``capturable_paths()``
makes that answer true outside a capture: the engine runs a step so just before capturing it
(so every kernel the capture launches is already built and loaded), and the testing kit's
simulated captures run under it on any device.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import traceback
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["CaptureRefused", "capturable_paths", "is_capturing", "kernelbay_line"]

_FORCED = contextvars.ContextVar("kernelbay_capturable_paths", default=False)

# Frames of these files are the capture machinery, never the line that broke a capture.
_MACHINERY = ("kernelbay/engine/graphs.py", "kernelbay/testing/capture.py",
              "kernelbay/capture.py")


class CaptureRefused(RuntimeError):
    """Raised by a layer whose capturable path would cost too much for this step (the MoE
    routing at a batch too small for running every expert): the engine runs steps of that
    shape eagerly, without a warning, and does not count it as a failed capture."""


@contextlib.contextmanager
def capturable_paths() -> Iterator[None]:
    """Within it ``is_capturing`` is true on every device: code takes the paths a CUDA graph
    capture can hold, though none is running."""
    token = _FORCED.set(True)
    try:
        yield
    finally:
        _FORCED.reset(token)


def is_capturing(x: torch.Tensor) -> bool:
    """Whether code on ``x``'s device should take its capturable path: a CUDA graph is being
    captured on the current stream, or ``capturable_paths`` is in effect."""
    if _FORCED.get():
        return True
    if not x.is_cuda:
        return False
    import torch

    return bool(torch.cuda.is_current_stream_capturing())


def kernelbay_line(frames: traceback.StackSummary | list[traceback.FrameSummary]) -> str | None:
    """The innermost of ``frames`` in kernelbay code (the core or an imported ``kernelbay_*``
    plugin package), outside the capture machinery, as ``kernelbay.../file.py:line in
    function``; ``None`` if there is none."""
    packages = _package_folders()
    for frame in reversed(frames):
        path = os.path.abspath(frame.filename)
        for name, folder in packages:
            if path.startswith(folder + os.sep):
                where = "/".join([name, *os.path.relpath(path, folder).split(os.sep)])
                if where.endswith(_MACHINERY):
                    break
                return f"{where}:{frame.lineno} in {frame.name}"
    return None


def _package_folders() -> list[tuple[str, str]]:
    """(name, folder) of the imported kernelbay packages: the core and its plugins."""
    found = []
    for name, module in list(sys.modules.items()):
        if "." in name or not (name == "kernelbay" or name.startswith("kernelbay_")):
            continue
        file = getattr(module, "__file__", None)
        if file:
            found.append((name, os.path.dirname(os.path.abspath(file))))
    return found
