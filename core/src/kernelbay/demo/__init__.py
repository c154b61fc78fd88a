"""The bundled demo model: a small byte-level DeepSeek-V3-architecture LM trained on the
Python standard library's own sources (see the model card, ``README.md`` in this folder).

Token ids 0-255 are the bytes of UTF-8 text; the special tokens follow. ``demo_path()`` is
the checkpoint folder, ``heldout_text()`` the fixed held-out evaluation sample.
"""

from __future__ import annotations

import os

__all__ = ["BOS_ID", "EOS_ID", "HELDOUT_FILES", "PAD_ID", "VOCAB_SIZE", "demo_path",
           "heldout_text"]

HERE = os.path.dirname(os.path.abspath(__file__))

#: 256 bytes + 32 special/reserved ids (a multiple of 32, which kernels like).
VOCAB_SIZE = 288
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258
SPECIAL_TOKENS = {"<|bos|>": BOS_ID, "<|eos|>": EOS_ID, "<|pad|>": PAD_ID}

#: Standard-library modules kept out of training; their CPython 3.11.7 sources, concatenated
#: in this order, are the held-out sample ``heldout.txt``.
HELDOUT_FILES = ("textwrap.py", "fractions.py", "heapq.py", "shlex.py", "colorsys.py",
                 "calendar.py", "string.py")


def demo_path() -> str:
    """The folder of the bundled demo checkpoint (config.json, model.safetensors, ...)."""
    return HERE


def heldout_text() -> str:
    """The fixed held-out evaluation sample."""
    with open(os.path.join(HERE, "heldout.txt"), encoding="utf-8") as f:
        return f.read()
