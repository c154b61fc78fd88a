"""Decode steps replayed from CUDA graphs.

A decode step of a small model launches a few hundred kernels whose host-side cost exceeds
their GPU time; a CUDA graph launches them all at once. A graph is captured per (batch,
block-table width): the second time a decode step of that shape comes (the first ran eagerly,
so every kernel it needs is compiled and loaded, which a capture cannot do), and replayed for
every later one, with the step's tokens, positions, slots, lengths and tables copied into the
graph's own input buffers first. The width is the pages the step's longest context needs,
rounded up to a power of two (``table_width``), so a graph's attention pads keys to at most
twice that context, not to every page a request reserved; attention sees that capacity as its
key bound (``AttentionMetadata.max_seq_len``) and no host lengths, which change at every
replay.

Batch sizes are bucketed the same way when the engine gives a scratch page (``LLM`` does:
``PagedKVCache.scratch_page``, one page no sequence owns): a step of B sequences runs in the
graph of ``graph_batch(B)``, the smallest of 1, 2, 3, 4, 6, 8, 12, 16, ... (powers of two and
three times powers of two) at least B, its pad rows decoding token 0 at position 0 with one
key, written to and read from the scratch page, and their logits dropped. At most a third of a
graph's rows are padding, and an engine whose batch size drifts from 1 to 256 needs 16 graphs
per width, not 256.

A model or backend that cannot be captured (it reads a device value on the host, or runs a
collective the capture cannot hold) fails the capture. The engine warns once, naming the
error and the line of the model or backend that raised it, and runs that batch size eagerly
from then on; other batch sizes still try. After ``MAX_FAILED_BATCHES`` batch sizes have
failed, the engine stops capturing. A layer may also decline a batch size by design
(``kernelbay.capture.CaptureRefused``: the MoE routing declines batches whose captured path
would cost far more than the routed experts): that size runs eagerly, with no warning and
not counted as a failure.
``KERNELBAY_CUDA_GRAPHS=0`` (or ``LLM(cuda_graphs=False)``) never captures.
"""

from __future__ import annotations

import contextlib
import os
import traceback
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kernelbay.capture import CaptureRefused, capturable_paths, kernelbay_line
from kernelbay.engine.modules import ForwardMeta
from kernelbay.engine.transfer import upload_into
from kernelbay.layers import AttentionMetadata

__all__ = ["DecodeGraphs", "capture_failure", "graph_batch", "graphs_enabled", "table_width"]

#: Most graphs one engine keeps (each holds its input buffers; memory comes from one pool);
#: past it the least recently replayed one is dropped.
MAX_GRAPHS = 32
#: Batch sizes whose capture may fail (each then runs eagerly) before capturing stops.
MAX_FAILED_BATCHES = 4


def graphs_enabled(device: torch.device) -> bool:
    """Whether decode steps on ``device`` may be captured: CUDA devices, unless
    ``KERNELBAY_CUDA_GRAPHS=0`` (``1`` or unset: on)."""
    if device.type != "cuda":
        return False
    value = os.environ.get("KERNELBAY_CUDA_GRAPHS", "1")
    if value not in ("", "0", "1"):
        raise ValueError(f"KERNELBAY_CUDA_GRAPHS={value!r}; valid: '1' (on, the default) or "
                         f"'0' (off)")
    return value != "0"


@dataclass
class _Graph:
    """One captured decode step and the buffers it reads and writes."""

    graph: Any  # torch.cuda.CUDAGraph (None until captured)
    # Every tensor the captured step reads is held here: the graph reads them by address,
    # so one freed after the capture would be read as whatever reuses its memory.
    starts: torch.Tensor
    ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    lengths: torch.Tensor
    tables: torch.Tensor
    logits: torch.Tensor


def table_width(longest: int, page_size: int, capacity: int) -> int:
    """Block-table columns a graph of a step whose longest context is ``longest`` keys sees:
    the pages that context needs, rounded up to a power of two, at most ``capacity`` (the
    tables' width). Attention then pads keys to at most twice the longest context, instead of
    to every page a request reserved for its ``max_tokens``, with one graph per power of two."""
    need = max(1, -(-longest // page_size))
    return min(capacity, 1 << (need - 1).bit_length())


def graph_batch(batch: int) -> int:
    """The graph size a decode step of ``batch`` sequences runs in: the smallest power of two
    or three times a power of two at least ``batch`` (1, 2, 3, 4, 6, 8, 12, 16, 24, ...), so
    at most a third of its rows are padding (none up to 4)."""
    if batch < 1:
        raise ValueError(f"graph_batch: batch={batch}; valid: >= 1")
    power = 1 << (batch - 1).bit_length()  # the power of two at or above batch
    three = 3 * power // 4  # the one below it times 1.5
    return three if batch <= three and power >= 4 else power


def capture_failure(exc: BaseException) -> str:
    """Why a capture failed, for an operator: the error that broke it (not the error of
    ending the capture it invalidated) and the innermost line of kernelbay code (core or
    plugin) it came from, ``file:line in function``."""
    cause = _cause(exc)
    text = f"{type(cause).__name__}: {str(cause).splitlines()[0][:200] if str(cause) else ''}"
    where = kernelbay_line(traceback.extract_tb(cause.__traceback__))
    return f"{text} (at {where})" if where and where not in text else text


def _cause(exc: BaseException) -> BaseException:
    """The error a capture failed on: torch ends an invalidated capture with an error of its
    own raised while handling the original (its implicit context); anything else is itself."""
    context = exc.__context__
    if isinstance(context, Exception) and exc.__cause__ is None and not exc.__suppress_context__:
        return context
    return exc


def _record(step: Callable[[], torch.Tensor], pool: Any) -> tuple[Any, torch.Tensor]:
    """Capture ``step`` into a new CUDA graph (memory from ``pool``, or a new pool):
    (graph, its output). A capture that fails leaves the caller on the stream it was on
    (torch's capture context ends the capture before it restores the stream, so an
    invalidated capture would otherwise leave the thread on the capture's side stream)."""
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.current_stream()
    try:
        with torch.inference_mode(), torch.cuda.graph(graph, pool=pool):
            out = step()
    except BaseException:
        torch.cuda.set_stream(stream)
        raise
    return graph, out


def _fill_step(entry: _Graph, ids: list[int], positions: list[int], slots: list[int],
               lengths: list[int], tables: list[list[int]]) -> None:
    """A step's values into a graph's input buffers."""
    for buffer, values in ((entry.ids, ids), (entry.positions, positions),
                           (entry.slots, slots), (entry.lengths, lengths),
                           (entry.tables, tables)):
        upload_into(buffer, values)


class DecodeGraphs:
    """The CUDA graphs of one engine's decode steps (see the module doc)."""

    def __init__(self, model: Any, caches: list[torch.Tensor], page_size: int,
                 device: torch.device,
                 record: Callable[[Callable[[], torch.Tensor], Any],
                                  tuple[Any, torch.Tensor]] | None = None,
                 scratch_page: int | None = None) -> None:
        self.model = model
        #: The page pad rows write and read (``graph_batch`` sizes), or ``None``: a graph per
        #: exact batch size.
        self.scratch_page = scratch_page
        #: ``record(step, pool) -> (graph, output)``: a CUDA graph capture, or a simulated one
        #: (``kernelbay.testing.simulated_graphs``).
        self.record = record or _record
        self.caches = caches
        self.page_size = page_size
        self.device = device
        #: Captured graphs, least recently replayed first.
        self.graphs: OrderedDict[tuple[int, int], _Graph] = OrderedDict()
        self.seen: set[tuple[int, int]] = set()
        #: Graph batch sizes that failed to capture (run eagerly), with why.
        self.failed: dict[int, str] = {}
        #: Graph batch sizes a layer declined to capture (``CaptureRefused``; run eagerly),
        #: with why.
        self.refused: dict[int, str] = {}
        #: Why capturing stopped (``MAX_FAILED_BATCHES`` failures), or ``None``.
        self.off_reason: str | None = None
        self.replays = 0
        self._pool: Any = None

    def run(self, ids: list[int], positions: list[int], slots: list[int],
            lengths: list[int], tables: list[list[int]]) -> torch.Tensor | None:
        """The logits [B, vocab] of a decode step (one new token per sequence) replayed from
        its graph, captured now if this shape ran once before; ``None`` when the caller
        should run the step eagerly (a shape seen for the first time, too many graphs,
        capturing off). The graph sees the first ``table_width`` columns of ``tables``, and
        ``graph_batch(B)`` rows when there is a scratch page (the pad rows' logits dropped)."""
        real = len(ids)
        batch = real if self.scratch_page is None else graph_batch(real)
        if self.off_reason is not None or batch in self.failed or batch in self.refused:
            return None
        width = table_width(max(lengths), self.page_size, len(tables[0]))
        tables = [row[:width] for row in tables]
        if batch > real and self.scratch_page is not None:
            # pad rows: token 0 at position 0, one key, on the scratch page
            pad, page = batch - real, self.scratch_page
            ids, positions = ids + [0] * pad, positions + [0] * pad
            slots, lengths = slots + [page * self.page_size] * pad, lengths + [1] * pad
            tables = tables + [[page] * width] * pad  # keys past the first: masked
        key = (batch, width)
        with (torch.cuda.device(self.device) if self.device.type == "cuda"
              else contextlib.nullcontext()):
            entry = self.graphs.get(key)
            if entry is None:
                if key not in self.seen:
                    self.seen.add(key)
                    return None
                entry = self._capture(*key, (ids, positions, slots, lengths, tables))
                if entry is None:
                    return None
                if len(self.graphs) >= MAX_GRAPHS:  # the least recently replayed goes
                    del self.graphs[next(iter(self.graphs))]
                self.graphs[key] = entry
            else:
                self.graphs.move_to_end(key)
                _fill_step(entry, ids, positions, slots, lengths, tables)
            entry.graph.replay()
            self.replays += 1
            # a copy: the graph's own output is rewritten by its next replay, and its memory
            # may be another graph's scratch space
            return entry.logits[:real].clone()

    def _capture(self, batch: int, width: int, values: tuple[list[Any], ...]) -> _Graph | None:
        """The graph of a step of ``batch`` sequences and ``width`` table columns, its buffers
        holding ``values`` (the step's ids, positions, slots, lengths and tables) and the step
        run once eagerly on them first, so that everything the graph launches is built and
        loaded in exactly its shapes (the step's cache writes then happen twice, with the same
        values), its layers taking their capturable paths (``kernelbay.capture``); ``None``
        (that batch size eager from now, with a warning the first time)
        when it cannot be captured."""
        dev = self.device
        ids = torch.zeros(batch, dtype=torch.long, device=dev)
        positions = torch.zeros(batch, dtype=torch.long, device=dev)
        slots = torch.zeros(batch, dtype=torch.long, device=dev)
        lengths = torch.ones(batch, dtype=torch.int32, device=dev)
        tables = torch.zeros(batch, width, dtype=torch.int32, device=dev)
        entry = _Graph(None, torch.arange(batch + 1, dtype=torch.int32, device=dev), ids,
                       positions, slots, lengths, tables, torch.empty(0))
        meta = ForwardMeta(AttentionMetadata(entry.starts, lengths, tables, slots,
                                              query_start_host=tuple(range(batch + 1)),
                                              max_seq_len=width * self.page_size),
                           self.caches)

        def step() -> torch.Tensor:
            hidden = self.model(ids, positions, meta)
            logits: torch.Tensor = self.model.compute_logits(hidden)
            return logits

        _fill_step(entry, *values)
        try:
            with torch.inference_mode(), capturable_paths():  # what the capture will run
                step()
            entry.graph, entry.logits = self.record(step, self._pool)
        except Exception as exc:  # a model or backend that cannot be captured: eager
            reason = capture_failure(exc)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            if isinstance(_cause(exc), CaptureRefused):  # by design: no warning, not counted
                self.refused[batch] = reason
                return None
            if not self.failed:
                low = batch  # the smallest real batch this graph size takes
                while self.scratch_page is not None and low > 1 and \
                        graph_batch(low - 1) == batch:
                    low -= 1
                sizes = f"{low}-{batch}" if low < batch else f"{batch}"
                warnings.warn(f"kernelbay: decode steps of {sizes} sequences run eagerly (no "
                              f"CUDA graph): capturing one failed: {reason}",
                              RuntimeWarning, stacklevel=4)
            self.failed[batch] = reason
            if len(self.failed) >= MAX_FAILED_BATCHES:
                self.off_reason = (f"{len(self.failed)} batch sizes failed to capture, the "
                                   f"last: {reason}")
            return None
        self._pool = entry.graph.pool()
        return entry
