# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# (Triton kernels are written in its untyped DSL; the Python wrappers are typed.)
"""Triton kernel for FP8 per-block weight-only linear (ModelOpt ``FP8_PB_WO``):
``y = x @ W^T`` with ``W[n, k] = float(q[n, k]) * scale[n // 128, k // 128]``.

The weight arrives padded (``fp8_block.pad_fp8_block``) to whole 128 x 128 tiles, so a
BLOCK_N x BLOCK_K tile (both dividing 128) lies inside one scale tile: one fp32 scale per
tile, and the weight loads need no masks. E4M3 is decoded from its bits (uint8 view):
``(b & 0x80) << 8 | (b & 0x7F) << 7`` is the fp16 pattern of the value times 2^-8, the 2^8 is
folded into the tile scale (``triton_kernels.e4m3_2m8``; no fp8 conversion
instructions needed, so compute capability 8.0 runs it). The padded columns of W are zero
and the matching x columns are masked to zero; padded rows are never stored.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from kernelbay_quant_nvfp4.triton_kernels import (
    e4m3_2m8,
    interpreting,
    kernels,
    split_plan,
    store_tile,
    sum_partials,
)

__all__ = ["fp8_block_linear_triton"]

TILE = 128


@triton.jit
def fp8_block_matmul(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, K, KP, stride_xm, stride_om,
                     stride_os, stride_sn, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     TILES_PER_SPLIT, PARTIAL: tl.constexpr, DOT_FP32: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # inside the padded N: no mask
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    scale_row = (pid_n * BLOCK_N) // 128
    k_tiles = KP // BLOCK_K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = pid_k * TILES_PER_SPLIT
    for t in range(first, first + TILES_PER_SPLIT):
        kk = t * BLOCK_K + offs_k
        # Tiles past the end (the last split's remainder) load zero weights; their scale
        # index is clamped to a real one.
        w = tl.load(w_ptr + offs_n[None, :] * KP + kk[:, None], mask=(kk < KP)[:, None],
                    other=0)
        s = tl.load(s_ptr + scale_row * stride_sn
                    + (tl.minimum(t, k_tiles - 1) * BLOCK_K) // 128) * 256.0
        wd = (e4m3_2m8(w) * s).to(x_ptr.dtype.element_ty)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :],
                    mask=m_ok[:, None] & (kk < K)[None, :], other=0.0)
        if DOT_FP32:
            # Interpreter only (its bf16 tl.dot multiplies raw bits); same products.
            acc += tl.dot(x.to(tl.float32), wd.to(tl.float32))
        else:
            acc += tl.dot(x, wd)
    store_tile(acc, out_ptr, b_ptr, offs_m, offs_n, m_ok, offs_n < N, stride_om,
               pid_k.to(tl.int64) * stride_os, HAS_BIAS, PARTIAL)


def fp8_block_linear_triton(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                            n: int, bias: torch.Tensor | None, *, block_m: int = 16,
                            block_n: int = 64, block_k: int = 128, split_k: int = 1,
                            num_warps: int = 4, num_stages: int = 4) -> torch.Tensor:
    """``x [M, K] @ W^T (+ bias)`` -> [M, n] for the padded ``weight`` E4M3 [Np, Kp] (both
    multiples of 128) with fp32 ``scales`` [Np/128, Kp/128]; ``n`` is the real N."""
    m, k = x.shape
    npad, kpad = weight.shape
    if npad % TILE or kpad % TILE or TILE % block_n or TILE % block_k:
        raise ValueError(f"fp8_block_linear_triton: padded weight {list(weight.shape)} must be "
                         f"whole {TILE}x{TILE} tiles and blocks ({block_n}, {block_k}) must "
                         f"divide {TILE}")
    k_tiles = kpad // block_k
    split_k, per_split = split_plan(k_tiles, split_k)
    w_bits = weight.view(torch.uint8)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bias_arg = bias if bias is not None else out
    grid = (npad // block_n, -(-m // block_m), split_k)
    opts: dict[str, Any] = {"num_warps": num_warps, "num_stages": num_stages} if x.is_cuda else {}
    interp = interpreting()
    kernel = _kernel()
    if split_k == 1:
        kernel[grid](x, w_bits, scales, bias_arg, out, m, n, k, kpad, x.stride(0),
                     out.stride(0), 0, scales.stride(0), HAS_BIAS=bias is not None,
                     BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                     TILES_PER_SPLIT=per_split, PARTIAL=False, DOT_FP32=interp, **opts)
        return out
    part = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    kernel[grid](x, w_bits, scales, bias_arg, part, m, n, k, kpad, x.stride(0), n, m * n,
                 scales.stride(0), HAS_BIAS=False, BLOCK_M=block_m, BLOCK_N=block_n,
                 BLOCK_K=block_k, TILES_PER_SPLIT=per_split, PARTIAL=True,
                 DOT_FP32=interp, **opts)
    return sum_partials(part, bias, out)


def _kernel() -> Any:
    # Re-import this module when TRITON_INTERPRET changed since it was imported (see
    # triton_kernels.kernels), so the decorator ran in the current mode.
    import importlib
    import sys

    if interpreting() != _BUILT_INTERPRETED:
        kernels()
        module = importlib.reload(sys.modules[__name__])
        return module.fp8_block_matmul
    return fp8_block_matmul


_BUILT_INTERPRETED = interpreting()
