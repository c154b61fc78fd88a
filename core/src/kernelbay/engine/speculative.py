"""Speculative decoding: a proposer drafts up to k tokens, one target forward verifies them.

Each step, for every running sequence: the proposer drafts ``d <= k`` tokens; the target runs
once over the uncached tokens plus the drafts, which gives logits for the ``d + 1`` positions
that follow the committed text; at each of them the target picks its token exactly as plain
decoding would (``sample_tokens``: greedy, or Gumbel-max with noise keyed by seed, position
and token id). Drafts are accepted while they equal the target's own pick; the first
mismatch is replaced by the target's token, and when all ``d`` match the target's next token
is a bonus. The output is therefore identical to plain decoding with the same seed, whatever
the proposer drafts. The KV cache keeps the entries of accepted tokens; rejected drafts'
entries lie beyond ``num_cached`` and are overwritten by the next step. Acceptance, KV
commit and rollback are per request; every request of the batch shares the one target
forward. The target hidden states the proposer declared are captured during that forward
and kept for the accepted positions only.
"""

from __future__ import annotations

import contextlib
import os
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, final

import torch

from kernelbay.engine.runner import ModelRunner, Sequence
from kernelbay.engine.sampling import sample_tokens
from kernelbay.layers import DraftBuffers, Proposer
from kernelbay.layers.proposer import DraftContext

__all__ = ["SpeculativeConfig", "SpeculativeDecoder", "TaggedCompile", "compile_tagged"]


@final
@dataclass(frozen=True)
class SpeculativeConfig:
    """Which proposer drafts (``method``, e.g. ``"ngram"`` or ``"dflash2"``), how many tokens
    per step (``num_speculative_tokens``), and the drafter weights where the method needs them."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    drafter: str | None = None

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got "
                             f"{self.num_speculative_tokens}")


class SpeculativeDecoder:
    """Runs draft-and-verify steps for one target: owns the proposer, its draft buffers and
    the window of target hidden states it declared (``Proposer.hidden_state_spec``).

    The buffers are allocated once for ``max_num_seqs`` requests. Each running sequence gets
    a row of the hidden-state window while it runs; the rows of finished sequences are
    reused.
    """

    def __init__(self, runner: ModelRunner, proposer: Proposer, num_speculative_tokens: int,
                 max_num_seqs: int, vocab_size: int, num_layers: int, hidden_size: int,
                 dtype: torch.dtype) -> None:
        self.runner = runner
        self.proposer = proposer
        device = runner.device
        self.buffers = DraftBuffers.allocate(proposer.draft_logits_spec(), max_num_seqs,
                                             num_speculative_tokens, vocab_size, device)
        spec = proposer.hidden_state_spec()
        self.layers: tuple[int, ...] = () if spec is None else spec.resolve(num_layers)
        window = 0 if spec is None else spec.window
        self.hidden: torch.Tensor | None = None
        if self.layers:
            self.hidden = torch.zeros(max_num_seqs, window, len(self.layers), hidden_size,
                                      dtype=dtype, device=device)
        self.num_hidden = torch.zeros(max_num_seqs, dtype=torch.long)
        self._rows: dict[int, int] = {}

    def _assign_rows(self, running: list[Sequence]) -> list[int]:
        live = {id(s) for s in running}
        self._rows = {key: row for key, row in self._rows.items() if key in live}
        used = set(self._rows.values())
        free = (r for r in range(self.num_hidden.shape[0]) if r not in used)
        for seq in running:
            if id(seq) not in self._rows:
                row = next(free)
                self._rows[id(seq)] = row
                self.num_hidden[row] = 0
        return [self._rows[id(s)] for s in running]

    def _context(self, running: list[Sequence], rows: list[int]) -> DraftContext:
        index = torch.tensor(rows)
        context = DraftContext(
            torch.tensor([s.num_cached for s in running]),
            torch.tensor([s.params.temperature for s in running], dtype=torch.float32),
            torch.tensor([s.params.seed for s in running], dtype=torch.long))
        if self.hidden is not None:
            context.hidden_states = self.hidden[index.to(self.hidden.device)]
            context.num_hidden = self.num_hidden[index].clone()
        return context

    def _keep_hidden(self, row: int, states: torch.Tensor) -> None:
        """Append ``states`` [n, layers, hidden] (oldest first) to ``row``'s window."""
        assert self.hidden is not None
        window = self.hidden.shape[1]
        n = min(states.shape[0], window)
        if n == 0:
            return
        if n < window:  # shift the kept rows left to make room
            self.hidden[row, :window - n] = self.hidden[row, n:].clone()
        self.hidden[row, window - n:] = states[states.shape[0] - n:]
        self.num_hidden[row] = min(window, int(self.num_hidden[row]) + n)

    def step(self, running: list[Sequence]) -> list[list[int]]:
        """One draft-and-verify step for ``running``; returns each sequence's new tokens
        (at least one each) and leaves ``tokens``/``num_cached`` consistent with them."""
        buffers = self.buffers
        k = buffers.tokens.shape[1]
        rows_of = self._assign_rows(running)
        self.proposer.propose([torch.tensor(s.tokens) for s in running], buffers,
                              self._context(running, rows_of))
        committed = [len(s.tokens) for s in running]
        drafts: list[list[int]] = []
        drafted = buffers.num_drafted[:len(running)].tolist()
        tokens = buffers.tokens[:len(running)].tolist()
        for row, seq in enumerate(running):
            room = seq.params.max_tokens - len(seq.generated) - 1
            count = max(0, min(int(drafted[row]), k, room))
            drafts.append([int(t) for t in tokens[row][:count]])
            seq.tokens.extend(drafts[-1])
        batch = [(s, len(s.tokens) - s.num_cached) for s in running]
        logits = self.runner.forward(batch, all_logits=True, capture=self.layers)
        # The last d + 1 rows of each sequence predict the positions after the committed text.
        rows: list[int] = []
        params = []
        positions: list[int] = []
        start = 0
        for (seq, num_new), base, draft in zip(batch, committed, drafts, strict=True):
            first = start + num_new - len(draft) - 1
            rows.extend(range(first, start + num_new))
            params.extend([seq.params] * (len(draft) + 1))
            positions.extend(range(base, base + len(draft) + 1))
            start += num_new
        picks = sample_tokens(logits[torch.tensor(rows, device=logits.device)], params,
                              positions).tolist()
        out: list[list[int]] = []
        offset = 0
        start = 0
        for (seq, num_new), base, draft, row in zip(batch, committed, drafts, rows_of,
                                                    strict=True):
            target = [int(t) for t in picks[offset:offset + len(draft) + 1]]
            offset += len(draft) + 1
            accepted = 0
            while accepted < len(draft) and draft[accepted] == target[accepted]:
                accepted += 1
            new = [*draft[:accepted], target[accepted]]
            del seq.tokens[base:]
            seq.tokens.extend(new)
            # Rejected drafts' K/V lie beyond num_cached and are overwritten next step; their
            # hidden states are dropped here.
            seq.num_cached = base + accepted
            if self.runner.captured is not None:
                keep = num_new - len(draft) + accepted
                self._keep_hidden(row, self.runner.captured[start:start + keep])
            start += num_new
            out.append(new)
        return out


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class TaggedCompile:
    """A module's ``forward`` compiled under ``tag`` (see ``compile_tagged``).

    ``code`` is the tagged copy of ``forward``'s code object that dynamo caches against;
    ``cache_dir`` the folder of this tag's inductor and Triton artifacts.
    """

    def __init__(self, module: torch.nn.Module, tag: str, cache_dir: str,
                 options: dict[str, Any]) -> None:
        if not tag.isidentifier():
            raise ValueError(f"compile tag must be an identifier (it names a code object), "
                             f"got {tag!r}")
        forward = type(module).forward
        name = f"{forward.__name__}__{tag}"
        self.code = forward.__code__.replace(co_name=name)
        function = types.FunctionType(self.code, forward.__globals__, name,
                                      forward.__defaults__, forward.__closure__)
        self.tag = tag
        self.cache_dir = cache_dir
        self.module = module
        self._compiled = torch.compile(types.MethodType(function, module), **options)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Compilation happens lazily inside the call, so the cache folders are set around it.
        with _environment(TORCHINDUCTOR_CACHE_DIR=self.cache_dir,
                          TRITON_CACHE_DIR=os.path.join(self.cache_dir, "triton")):
            return self._compiled(*args, **kwargs)


def compile_tagged(module: torch.nn.Module, tag: str, cache_root: str | None = None,
                   **options: Any) -> TaggedCompile:
    """``torch.compile`` of ``module.forward`` whose compiled artifacts belong to ``tag``.

    The target and a drafter (or two models of the same class) never share compiled code:
    each tag compiles its own copy of the ``forward`` code object, so dynamo's per-code cache
    entries, guards and recompilation limit are separate, and inductor/Triton write their
    files under ``cache_root/<tag>`` (default: the kernelbay cache, ``compile/<tag>``).
    ``options`` go to ``torch.compile`` (``backend``, ``mode``, ``dynamic`` ...).
    """
    from kernelbay.cache import cache_dir

    root = cache_root if cache_root is not None else str(cache_dir("compile"))
    return TaggedCompile(module, tag, os.path.join(root, tag), options)
