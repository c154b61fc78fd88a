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
import traceback
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["capturable_paths", "is_capturing", "kernelbay_line"]

_FORCED = contextvars.ContextVar("kernelbay_capturable_paths", default=False)

# Frames of these files are the capture machinery, never the line that broke a capture.
_MACHINERY = ("kernelbay/engine/graphs.py", "kernelbay/testing/capture.py", "kernelbay/capture.py")


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
    """The innermost of ``frames`` in kernelbay code (the core or a ``kernelbay_*`` plugin),
    outside the capture machinery, as ``kernelbay.../file.py:line in function``; ``None`` if
    there is none."""
    for frame in reversed(frames):
        parts = frame.filename.replace("\\", "/").split("/")
        top = next((i for i, part in enumerate(parts) if part.startswith("kernelbay")), None)
        if top is None:
            continue
        where = "/".join(parts[top:])
        if any(m in where for m in _MACHINERY):
            continue
        return f"{where}:{frame.lineno} in {frame.name}"
    return None
