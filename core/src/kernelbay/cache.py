"""Where kernelbay keeps what it builds or converts once (compiled kernels, quantized demos)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir"]


def cache_dir(*parts: str) -> Path:
    """``$KERNELBAY_CACHE_DIR``, else ``$XDG_CACHE_HOME/kernelbay``, else
    ``~/.cache/kernelbay``; ``parts`` name a subfolder (not created here)."""
    explicit = os.environ.get("KERNELBAY_CACHE_DIR")
    if explicit:
        root = Path(explicit).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "kernelbay"
    return root.joinpath(*parts)
