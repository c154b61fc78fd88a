"""Each token's routed slot outputs added up: the last step of a grouped-GEMM MoE layer.

A grouped down projection writes one float32 row per routed slot (slot ``t * K + k`` is
token t's k-th expert, already times its routing weight). The layer's output row t is then
``y[t * K] + y[t * K + 1] + ... + y[t * K + K - 1]``, added left to right in float32 and
rounded once to the activations' dtype. ``sum_slots`` does that in one pass: on CUDA one
Triton kernel (the sum and the rounding in one launch, where a tensor sum and a cast took
two, each a few microseconds inside a captured one-token decode step), elsewhere tensor
operations in the same order, so both give the same bits (a NaN's payload aside: each
conversion writes its own).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["KERNELS", "OUT_DTYPES", "sum_slots"]

#: ``kernel`` choices of ``sum_slots``.
KERNELS = ("auto", "torch", "triton")
#: ``out_dtype`` choices (the activations' float types, which both paths round alike).
OUT_DTYPES = ("torch.float32", "torch.bfloat16", "torch.float16")


def sum_slots(y: torch.Tensor, top_k: int, out_dtype: torch.dtype, *,
              kernel: str = "auto") -> torch.Tensor:
    """``out[t] = y[t * top_k] + ... + y[t * top_k + top_k - 1]`` for float32 ``y``
    [T * top_k, N], added left to right in float32 and rounded once: [T, N] in ``out_dtype``.
    ``kernel``: one of ``KERNELS`` (``"auto"``: the Triton kernel for CUDA tensors where
    Triton is installed, else tensor operations; both give the same bits but for NaN
    payloads). ``out_dtype``: one of ``OUT_DTYPES``. ``ValueError`` naming the bad argument
    and what was expected."""
    import torch

    if kernel not in KERNELS:
        raise ValueError(f"sum_slots: kernel={kernel!r}; valid: {KERNELS}")
    if top_k < 1:
        raise ValueError(f"sum_slots: top_k={top_k} must be >= 1")
    if y.dtype != torch.float32 or y.dim() != 2 or y.shape[0] % top_k:
        raise ValueError(f"sum_slots: y must be float32 [tokens * top_k, N] with top_k="
                         f"{top_k}, got {y.dtype} {tuple(y.shape)}")
    if str(out_dtype) not in OUT_DTYPES:
        raise ValueError(f"sum_slots: out_dtype={out_dtype}; valid: {OUT_DTYPES}")
    tokens, n = y.shape[0] // top_k, y.shape[1]
    if kernel == "triton" or (kernel == "auto" and _triton_takes(y)):
        from kernelbay.layers.slot_sum_triton import sum_slots_triton

        return sum_slots_triton(y, top_k, out_dtype)
    rows = y.view(tokens, top_k, n)
    out = rows[:, 0].clone()
    for k in range(1, top_k):  # left to right, as the kernel adds
        out += rows[:, k]
    return out.to(out_dtype)


def _triton_takes(y: torch.Tensor) -> bool:
    """Whether ``kernel="auto"`` runs the Triton kernel: a CUDA tensor, Triton installed."""
    if not y.is_cuda:
        return False
    import importlib.util

    return importlib.util.find_spec("triton") is not None
