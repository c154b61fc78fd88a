"""Held-out bits per byte: the demo model's quality number, computed the same way everywhere."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from kernelbay.demo import BOS_ID

__all__ = ["WINDOW", "bits_per_byte"]

#: Bytes per evaluation window; each window is scored after a BOS token, independently.
WINDOW = 512


def bits_per_byte(logits_fn: Callable[[list[int]], Any], text: str,
                  window: int = WINDOW) -> float:
    """Mean negative log2-likelihood per byte of ``text``, in windows of ``window`` bytes.

    ``logits_fn(ids)`` returns logits [len(ids), vocab] for a token list. Each window is
    ``[BOS] + bytes``; every byte is predicted from the ones before it in its window.
    """
    import torch

    data = list(text.encode("utf-8"))
    total = 0.0
    for start in range(0, len(data), window):
        chunk = data[start:start + window]
        ids = [BOS_ID, *chunk]
        logits = torch.as_tensor(logits_fn(ids)).float()[:-1]
        logprobs = torch.log_softmax(logits, dim=-1)
        target = torch.tensor(chunk)
        total -= float(logprobs[torch.arange(len(chunk)), target].double().sum())
    return total / math.log(2) / len(data)
