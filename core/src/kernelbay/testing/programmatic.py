"""A GPU check for kernels that become programmatic dependents in CUDA graphs
(``KERNELBAY_PDL=1``, ``kernelbay.cuda_jit.programmatic_dependent`` and
``kernelbay.triton_pdl``): they must give the bits of plain launches while reading their
inputs only after the kernel before them has finished."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["check_programmatic_chain"]


def check_programmatic_chain(monkeypatch: Any, layers: Sequence[Callable[[torch.Tensor],
                                                                   torch.Tensor]],
                             inputs: Sequence[torch.Tensor], *,
                             edges: int | None = None) -> None:
    """Run ``layers`` as a chain (each reading the output of the one before) on each of
    ``inputs`` (CUDA tensors), launched plainly (``KERNELBAY_PDL=0``), then with
    ``KERNELBAY_PDL=1`` eagerly (plain launches of the waiting and releasing builds) and
    replayed from a CUDA graph captured then, which must hold ``edges`` programmatic edges
    (default: one per layer after the first, each layer's first kernel depending on the last
    kernel of the layer before): the same bits every time. Every
    replay has fresh activations, so a layer that read its input before the kernel before it
    finished would see the previous replay's values."""
    from kernelbay.cuda_jit import programmatic_edges, programmatic_launch

    def chain(x: torch.Tensor) -> torch.Tensor:
        for layer in layers:
            x = layer(x)
        return x

    monkeypatch.setenv("KERNELBAY_PDL", "0")
    want = [chain(x) for x in inputs]
    assert all(bool(w.isfinite().all()) and bool(w.abs().sum() > 0) for w in want)
    monkeypatch.setenv("KERNELBAY_PDL", "1")
    assert programmatic_launch()
    got = [chain(x) for x in inputs]
    torch.cuda.synchronize()
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    static = inputs[0].clone()
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    before = programmatic_edges()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = chain(static)
    made = programmatic_edges() - before
    want_edges = len(layers) - 1 if edges is None else edges
    assert made == want_edges, (
        f"{made} programmatic edges in the graph of a chain of {len(layers)} layers, expected "
        f"{want_edges}")
    for x, w in zip(list(inputs[1:]) + list(inputs[:1]), want[1:] + want[:1], strict=True):
        static.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, w)
