# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# (Triton kernels are written in its untyped DSL; the Python wrapper is typed.)
"""``sum_slots`` as one Triton kernel: each program adds one token's ``top_k`` slot rows over
``BLOCK`` columns, left to right in float32, and stores the rounded result. On compute
capability 9.0+ it waits and releases as a programmatic launch (``kernelbay.triton_pdl``), so
in a CUDA graph it may depend on the grouped GEMM before it, and a kernel of ours after it
(a latent MoE's output projection) may depend on it. This module imports triton:
``sum_slots`` imports it only when it runs the kernel.

Each program lets the next launch start once its loads are done (``RELEASE_POINTS``):
released at its start, the next launch's blocks took the free SM slots while the sum still
streamed its rows, and it ran slower. Measured on an H100 (graphs of 20 calls, us per call,
``bench/results/moe-slot-sum-release-h100.md``, from a scratch form of
``bench/moe_routing/slot_sum_release.py``): followed by a dense MXFP4 GEMM (7168 -> 2048) at
16 tokens, 16.5 released at the start, 10.2 after the loads, 10.4 at the end, 10.9 plain;
128 tokens summed back to back, 10.8, 5.7, 6.1 and 6.5.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import triton
import triton.language as tl

from kernelbay import triton_pdl
from kernelbay.formats.bf16_triton import bf16_bits_rne
from kernelbay.triton_pdl import grid_release, grid_wait

if TYPE_CHECKING:
    import torch

__all__ = ["RELEASE_POINTS", "sum_slots_triton"]

#: Columns per program (eight per thread with four warps).
_BLOCK = 1024
#: Where a program may let the next programmatic launch start: at its start, once its loads
#: are done (the default), or after its store.
RELEASE_POINTS = ("start", "loads", "end")


@triton.jit
def _sum_slots_kernel(y_ptr, out_ptr, N, TOP_K: tl.constexpr, BLOCK: tl.constexpr,
                      OUT_BF16_BITS: tl.constexpr, PDL: tl.constexpr = False,
                      RELEASE: tl.constexpr = 1):
    # RELEASE: the index of the release point in RELEASE_POINTS
    if PDL:  # the slot rows are the kernel before's output
        grid_wait()
        if RELEASE == 0:
            grid_release()
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    row = y_ptr + token * TOP_K * N + cols
    acc = tl.load(row, mask=ok, other=0.0)
    for k in tl.static_range(1, TOP_K):
        acc += tl.load(row + k * N, mask=ok, other=0.0)
    if PDL and RELEASE == 1:
        grid_release()
    dest = out_ptr + token * N + cols
    if OUT_BF16_BITS:  # the interpreter's bf16 conversion truncates: store the RNE bits
        tl.store(dest, bf16_bits_rne(acc), mask=ok)
    else:
        tl.store(dest, acc.to(out_ptr.dtype.element_ty), mask=ok)
    if PDL and RELEASE == 2:
        grid_release()


def sum_slots_triton(y: torch.Tensor, top_k: int, out_dtype: torch.dtype, *,
                     release: str = "loads") -> torch.Tensor:
    """``kernelbay.layers.slot_sum.sum_slots`` by the Triton kernel (arguments checked
    there): one launch, no host sync, so a captured decode step can hold it. ``release``:
    one of ``RELEASE_POINTS``, where a programmatic launch lets the next one start (the
    benchmark compares them; the result is the same)."""
    import torch

    if release not in RELEASE_POINTS:
        raise ValueError(f"sum_slots_triton: release={release!r}; valid: {RELEASE_POINTS}")
    tokens, n = y.shape[0] // top_k, y.shape[1]
    out = torch.empty(tokens, n, dtype=out_dtype, device=y.device)
    if tokens == 0 or n == 0:
        return out
    y = y if y.is_contiguous() else y.contiguous()
    interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    bits = interpreting and out_dtype == torch.bfloat16
    grid = (tokens, triton.cdiv(n, _BLOCK))
    pdl = triton_pdl.enabled(y.device)
    with triton_pdl.dependent(y.device, pdl):
        _sum_slots_kernel[grid](y, out.view(torch.int16) if bits else out, n, TOP_K=top_k,
                                BLOCK=_BLOCK, OUT_BF16_BITS=bits, PDL=pdl,
                                RELEASE=RELEASE_POINTS.index(release), num_warps=4)
    return out
