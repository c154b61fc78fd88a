"""Pieces the MoE benchmarks share (``bench/nvfp4/moe.py``, ``bench/mxfp4/moe.py``): the layer's
command-line options, the bf16 grouped-GEMM baseline and the uniform random routing."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

#: Token counts timed by default.
TOKENS = (1, 4, 16, 64, 256, 1024)


def add_layer_args(parser: argparse.ArgumentParser) -> None:
    """The MoE layer's options: one DeepSeek-V3-family layer by default (``--experts 256
    --top-k 8 --hidden 7168 --inter 2048``), ``--tokens``, ``--distinct``."""
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--inter", type=int, default=2048, help="expert intermediate size")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)),
                        help="T list, e.g. 1,16")
    parser.add_argument("--distinct", type=int, default=8,
                        help="distinct random experts, copied to fill all (the contents do "
                             "not change the speed; every expert still has its own memory)")


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


def bf16_baselines(x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, w13: torch.Tensor,
                   w2: torch.Tensor, timed: Callable[..., float], failures: list[str],
                   notes: set[str], reference: tuple[str, torch.Tensor] | None = None
                   ) -> tuple[Callable[[str, torch.Tensor], float], dict[str, Any]]:
    """The bf16 experts of one routing, timed: ``bf16_us`` (per expert, the routing read on
    the host, eager) and ``bf16_grouped_graph_us`` (``bf16_grouped`` from a CUDA graph; a
    note instead where torch lacks the grouped GEMM), with ``routed_experts``. Returns them
    and ``check(what, got)``, which compares a result with the per-expert one, or with
    ``reference`` (its name and value: e.g. the same experts on quantized activations), to
    2^-5 of its largest magnitude (far below what a wrong expert, scale or routing weight
    gives), appends a mismatch to ``failures`` and returns the largest error."""
    import torch.nn.functional as F
    from kernelbay.layers.moe import swiglu_experts

    def checker(against: str, want: torch.Tensor) -> Callable[[str, torch.Tensor], float]:
        scale = float(want.float().abs().amax())

        def check(what: str, got: torch.Tensor) -> float:
            error = float((got.float() - want.float()).abs().amax())
            if got.shape != want.shape or not error <= 2**-5 * max(scale, 1e-6):
                failures.append(f"{what} vs {against} at T={x.shape[0]}: max error "
                                f"{error:.3g}, output scale {scale:.3g}")
            return error
        return check

    check_dense = checker("bf16 per-expert", swiglu_experts(x, ids, wts, w13, w2, F.linear))
    row: dict[str, Any] = {"routed_experts": len(set(ids.reshape(-1).tolist())),
                           "bf16_us": timed(lambda: swiglu_experts(x, ids, wts, w13, w2,
                                                                   F.linear))}
    try:
        check_dense("bf16 grouped", bf16_grouped(x, ids, wts, w13, w2))
    except (RuntimeError, AttributeError, NotImplementedError) as exc:
        notes.add(f"bf16 grouped (torch._grouped_mm) not run: {type(exc).__name__}: "
                  f"{str(exc)[:200]}")
    else:
        row["bf16_grouped_graph_us"] = timed(lambda: bf16_grouped(x, ids, wts, w13, w2), True)
    return (checker(*reference) if reference else check_dense), row
