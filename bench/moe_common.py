"""Pieces the MoE benchmarks share (``bench/nvfp4/moe.py``, ``bench/mxfp4/moe.py``): the bf16
grouped-GEMM baseline and the uniform random routing."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def bf16_grouped(x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, w13: torch.Tensor,
                 w2: torch.Tensor) -> torch.Tensor:
    """SwiGLU experts on dense bf16 weights ``w13`` [E, 2I, H], ``w2`` [E, H, I] by torch's
    grouped GEMM (``torch._grouped_mm``) over the slots sorted by expert: nothing read on the
    host, so it can be replayed from a CUDA graph. Raises where torch lacks the GEMM."""
    import torch
    import torch.nn.functional as F

    experts, hidden, inter = w13.shape[0], w2.shape[1], w2.shape[2]
    flat = ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    tok = order // ids.shape[1]
    counts = torch.zeros(experts, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    gu = torch._grouped_mm(x[tok], w13.transpose(-2, -1), offs=offs)
    h = F.silu(gu[:, :inter]) * gu[:, inter:]
    y = torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)
    out = torch.zeros(x.shape[0], hidden, dtype=torch.float32, device=x.device)
    out.index_add_(0, tok, y.float() * wts.reshape(-1)[order, None].float())
    return out.to(x.dtype)


def uniform_routing(tokens: int, experts: int, top_k: int, gen: torch.Generator, device: str
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``top_k`` distinct experts per token, uniformly at random, and routing weights in
    [0.1, 1.1) (from the CPU generator ``gen``, moved to ``device``)."""
    import torch

    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    return ids.to(device), (torch.rand(tokens, top_k, generator=gen) + 0.1).to(device)
