"""The bundled demo model: a small byte-level DeepSeek-V3-architecture LM trained on the
Python standard library's own sources (see the model card, ``README.md`` in this folder).

Token ids 0-255 are the bytes of UTF-8 text; the special tokens follow. ``demo_path()`` is
the checkpoint folder, ``heldout_text()`` the fixed held-out evaluation sample.
"""

from __future__ import annotations

import os

__all__ = ["BOS_ID", "EOS_ID", "HELDOUT_FILES", "PAD_ID", "VOCAB_SIZE", "demo_path",
           "heldout_text", "heldout_windows"]

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


def heldout_windows(count: int, *, seed: int, shortest: int = 64, spread: int = 128
                    ) -> list[str]:
    """``count`` windows of the held-out sample, the prompts of the speculative-decoding
    tests, benchmark and drafter evaluation: starts drawn by torch's generator seeded with
    ``seed``, the window at start ``s`` ``shortest + s % spread`` characters long."""
    import torch

    text = heldout_text()
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(text) - 400, (count,), generator=gen).tolist()
    return [text[s:s + shortest + s % spread] for s in starts]
