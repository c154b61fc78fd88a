"""Running the model on a batch of sequences: packing tokens, building the paged attention
metadata, and returning the logits the caller asked for."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kernelbay.engine.graphs import DecodeGraphs
from kernelbay.engine.kv_cache import PagedKVCache
from kernelbay.engine.modules import ForwardMeta
from kernelbay.engine.sampling import SamplingParams
from kernelbay.engine.transfer import upload
from kernelbay.layers import AttentionMetadata

__all__ = ["ModelRunner", "Sequence"]


@dataclass
class Sequence:
    """One request in flight: its tokens, its pages and how many tokens are cached."""

    index: int
    tokens: list[int]
    num_prompt: int
    params: SamplingParams
    pages: list[int] = field(default_factory=list)
    num_cached: int = 0
    finish_reason: str | None = None
    step_times: list[float] = field(default_factory=list)
    steps: int = 0

    @property
    def generated(self) -> list[int]:
        """Tokens produced so far."""
        return self.tokens[self.num_prompt:]


class ModelRunner:
    """Runs forward passes of ``model`` over sequences whose K/V live in ``cache``."""

    def __init__(self, model: Any, cache: PagedKVCache, device: torch.device,
                 graphs: DecodeGraphs | None = None) -> None:
        self.model = model
        self.cache = cache
        self.device = device
        #: Decode steps replayed from CUDA graphs (``None``: always eager).
        self.graphs = graphs
        #: The states ``forward(..., capture=...)`` took last (see ``forward``).
        self.captured: torch.Tensor | None = None

    def forward(self, batch: list[tuple[Sequence, int]], all_logits: bool = False,
                capture: tuple[int, ...] = ()) -> torch.Tensor:
        """Run the ``num_new`` uncached tokens of each sequence; cache their K/V.

        Returns the logits of each sequence's last token [B, V], or of every new token
        [sum num_new, V] when ``all_logits``. With ``capture`` (hidden-state layer indices,
        ``CausalLM.forward_capturing``), ``self.captured`` holds those layers' states of
        every new token [sum num_new, len(capture), hidden] afterwards.
        """
        page = self.cache.page_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        lengths = []
        width = max(len(seq.pages) for seq, _ in batch)
        tables: list[list[int]] = []
        for seq, num_new in batch:
            end = seq.num_cached + num_new
            span = range(seq.num_cached, end)
            ids.extend(seq.tokens[seq.num_cached:end])
            positions.extend(span)
            slots.extend(seq.pages[p // page] * page + p % page for p in span)
            starts.append(starts[-1] + num_new)
            lengths.append(end)
            tables.append(seq.pages + [0] * (width - len(seq.pages)))
        decode = all(num_new == 1 for _, num_new in batch)
        if self.graphs is not None and not all_logits and not capture and decode:
            replayed = self.graphs.run(ids, positions, slots, lengths, tables)
            if replayed is not None:
                for seq, num_new in batch:
                    seq.num_cached += num_new
                return replayed
        # Every table goes up without a stream sync (``upload``), and the attention backends
        # get the host copies of the two they may need on the host: a step's kernels are then
        # queued without waiting for the previous ones, once per step (the sampled tokens).
        dev = self.device
        meta = ForwardMeta(
            AttentionMetadata(upload(starts, torch.int32, dev), upload(lengths, torch.int32, dev),
                              upload(tables, torch.int32, dev), upload(slots, torch.long, dev),
                              query_start_host=tuple(starts), seq_lens_host=tuple(lengths),
                              max_seq_len=max(lengths)),
            self.cache.caches)
        token_ids, token_positions = upload(ids, torch.long, dev), upload(positions, torch.long, dev)
        with torch.inference_mode():
            if capture:
                hidden, self.captured = self.model.forward_capturing(
                    token_ids, token_positions, meta, capture)
            else:
                hidden = self.model(token_ids, token_positions, meta)
            if not all_logits and not decode:
                # the last new token of each sequence (a decode step has only those)
                hidden = hidden[upload(starts[1:], torch.long, dev) - 1]
            logits: torch.Tensor = self.model.compute_logits(hidden)
        for seq, num_new in batch:
            seq.num_cached += num_new
        return logits
