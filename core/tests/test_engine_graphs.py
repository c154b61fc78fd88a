"""Decode steps replayed from CUDA graphs (``engine.graphs``): when a graph is captured and
replayed, what its buffers receive, the eager fallback, and on a GPU the same tokens as eager
steps."""

from __future__ import annotations

import contextlib
import re
import warnings
from typing import Any

import pytest
import torch
from engine_helpers import save_tiny
from kernelbay import Policy, Registry
from kernelbay.engine import LLM, SamplingParams
from kernelbay.engine import graphs as graphs_module
from kernelbay.engine.graphs import (
    MAX_FAILED_BATCHES,
    DecodeGraphs,
    capture_failure,
    graph_batch,
    graphs_enabled,
    table_width,
)
from kernelbay.testing.capture import simulated_graphs

CORE_ONLY = Registry(Policy(plugins=frozenset()))


def test_graphs_are_for_cuda_devices_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not graphs_enabled(torch.device("cpu"))
    assert graphs_enabled(torch.device("cuda"))
    monkeypatch.setenv("KERNELBAY_CUDA_GRAPHS", "0")
    assert not graphs_enabled(torch.device("cuda"))
    monkeypatch.setenv("KERNELBAY_CUDA_GRAPHS", "yes")
    with pytest.raises(ValueError, match="KERNELBAY_CUDA_GRAPHS='yes'; valid"):
        graphs_enabled(torch.device("cuda"))
    assert not graphs_enabled(torch.device("cpu"))  # not read where graphs never apply


class _Replay:
    def __init__(self) -> None:
        self.count = 0

    def replay(self) -> None:
        self.count += 1


def _fake_capture(graphs: DecodeGraphs, made: list[tuple[int, int]]) -> Any:
    def capture(batch: int, width: int, values: tuple[list[Any], ...]) -> Any:
        made.append((batch, width))
        entry = graphs_module._Graph(
            _Replay(), torch.arange(batch + 1, dtype=torch.int32),
            torch.zeros(batch, dtype=torch.long),
            torch.zeros(batch, dtype=torch.long), torch.zeros(batch, dtype=torch.long),
            torch.zeros(batch, dtype=torch.int32), torch.zeros(batch, width, dtype=torch.int32),
            torch.full((batch, 7), float(batch)))
        graphs_module._fill_step(entry, *values)
        return entry
    return capture


def test_a_shape_runs_eagerly_once_then_is_captured_and_replayed() -> None:
    graphs = DecodeGraphs(None, [], 16, torch.device("cpu"))
    made: list[tuple[int, int]] = []
    graphs._capture = _fake_capture(graphs, made)  # type: ignore[method-assign]
    step = ([3, 4], [10, 20], [5, 6], [11, 21], [[1, 2], [3, 0]])
    assert graphs.run(*step) is None and made == []          # first time: eager, warms up
    logits = graphs.run(*step)
    assert logits is not None and made == [(2, 2)] and graphs.replays == 1
    entry = graphs.graphs[(2, 2)]
    assert entry.ids.tolist() == [3, 4] and entry.positions.tolist() == [10, 20]
    assert entry.slots.tolist() == [5, 6] and entry.lengths.tolist() == [11, 21]
    assert entry.tables.tolist() == [[1, 2], [3, 0]]
    assert logits is not entry.logits and torch.equal(logits, entry.logits)  # a copy
    nxt = ([7, 8], [11, 21], [7, 8], [12, 22], [[1, 2], [3, 0]])
    assert torch.equal(graphs.run(*nxt), logits) and made == [(2, 2)]  # replayed only
    assert entry.ids.tolist() == [7, 8] and entry.graph.count == 2
    assert graphs.run([1], [1], [1], [2], [[1, 2, 3]]) is None  # another shape: eager first


def test_graph_batches_are_powers_of_two_and_three_times_powers_of_two() -> None:
    assert [graph_batch(b) for b in range(1, 18)] == [1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12, 12,
                                                      16, 16, 16, 16, 24]
    assert graph_batch(255) == 256 and graph_batch(256) == 256 and graph_batch(257) == 384
    for b in range(1, 1025):  # at most a third of a graph's rows are padding
        assert b <= graph_batch(b) and 3 * (graph_batch(b) - b) < graph_batch(b)
    with pytest.raises(ValueError, match="batch=0; valid: >= 1"):
        graph_batch(0)


def test_with_a_scratch_page_a_step_is_padded_to_its_graph_batch() -> None:
    graphs = DecodeGraphs(None, [], 16, torch.device("cpu"), scratch_page=9)
    made: list[tuple[int, int]] = []
    graphs._capture = _fake_capture(graphs, made)  # type: ignore[method-assign]

    def step(batch: int, first: int) -> tuple[list[Any], ...]:
        rows = range(first, first + batch)
        return ([10 + r for r in rows], [20 + r for r in rows], [30 + r for r in rows],
                [21 + r for r in rows], [[r, r + 1] for r in rows])

    assert graphs.run(*step(5, 0)) is None  # first time: eager, as unpadded
    logits = graphs.run(*step(5, 0))
    assert made == [(6, 2)] and logits is not None and logits.shape == (5, 7)
    entry = graphs.graphs[(6, 2)]
    # the pad row: token 0 at position 0, one key, in the scratch page's first slot
    assert entry.ids.tolist() == [10, 11, 12, 13, 14, 0]
    assert entry.positions.tolist() == [20, 21, 22, 23, 24, 0]
    assert entry.slots.tolist() == [30, 31, 32, 33, 34, 9 * 16]
    assert entry.lengths.tolist() == [21, 22, 23, 24, 25, 1]
    assert entry.tables.tolist()[-1] == [9, 9]
    # six sequences replay the same graph, unpadded
    assert graphs.run(*step(6, 1)).shape == (6, 7) and made == [(6, 2)]
    assert entry.ids.tolist() == [11, 12, 13, 14, 15, 16] and entry.graph.count == 2


def test_a_failed_padded_capture_names_the_batch_sizes_it_covers() -> None:
    class Model:
        def __call__(self, ids: torch.Tensor, positions: torch.Tensor, meta: Any) -> Any:
            return torch.zeros(ids.shape[0], 4)

        def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
            return hidden

    def record(step: Any, pool: Any) -> Any:
        raise RuntimeError("no capture here")

    graphs = DecodeGraphs(Model(), [], 16, torch.device("cpu"), record=record, scratch_page=2)
    step = ([1] * 7, [1] * 7, [1] * 7, [2] * 7, [[1]] * 7)
    assert graphs.run(*step) is None
    with pytest.warns(RuntimeWarning, match="decode steps of 7-8 sequences run eagerly .* "
                                            "RuntimeError: no capture here"):
        assert graphs.run(*step) is None
    assert set(graphs.failed) == {8}
    eight = ([1] * 8, [1] * 8, [1] * 8, [2] * 8, [[1]] * 8)  # same graph size: not tried again
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert graphs.run(*eight) is None and graphs.run(*eight) is None


def test_past_the_graph_limit_the_least_recently_replayed_graph_goes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(graphs_module, "MAX_GRAPHS", 2)
    graphs = DecodeGraphs(None, [], 16, torch.device("cpu"))
    made: list[tuple[int, int]] = []
    graphs._capture = _fake_capture(graphs, made)  # type: ignore[method-assign]

    def step(batch: int) -> tuple[list[Any], ...]:
        return [1] * batch, [1] * batch, [1] * batch, [2] * batch, [[1]] * batch

    for batch in (1, 2, 1, 2, 1):      # captures 1 and 2; 1 replayed last
        graphs.run(*step(batch))
    for _ in range(2):                 # 3: eager, then captured in place of 2
        graphs.run(*step(3))
    assert list(graphs.graphs) == [(1, 1), (3, 1)] and made == [(1, 1), (2, 1), (3, 1)]


def test_a_failed_capture_warns_once_and_leaves_that_batch_size_eager(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The capture's own machinery stood in for (no CUDA here): the model raises only inside
    # the capture (its eager run before passes), and ending the capture then raises an error
    # of its own while that one propagates, as torch does; the first is reported.
    capturing: list[bool] = []

    @contextlib.contextmanager
    def graph(graph: Any, pool: Any = None) -> Any:
        capturing.append(True)
        try:
            yield
        finally:
            capturing.clear()
            raise RuntimeError("CUDA error: operation failed due to a previous error during "
                               "capture")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Replay)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: "the stream")
    streams: list[Any] = []
    monkeypatch.setattr(torch.cuda, "set_stream", streams.append)
    graphs = DecodeGraphs(None, [], 16, torch.device("cpu"))
    calls: list[int] = []

    def step(batch: int) -> tuple[list[Any], ...]:
        return [3] * batch, [10] * batch, [5] * batch, [11] * batch, [[1]] * batch

    class Model:
        def __call__(self, ids: torch.Tensor, positions: torch.Tensor, meta: Any) -> Any:
            calls.append(ids.shape[0])
            if capturing:
                raise RuntimeError("operation not permitted when stream is capturing\nmore")
            return torch.zeros(ids.shape[0], 4)

        def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
            return hidden

    graphs.model = Model()
    graphs.run(*step(1))
    with pytest.warns(RuntimeWarning, match="steps of 1 sequences run eagerly .* RuntimeError: "
                                            "operation not permitted when stream is capturing$"):
        assert graphs.run(*step(1)) is None
    assert graphs.failed == {1: "RuntimeError: operation not permitted when stream is capturing"}
    assert graphs.off_reason is None and graphs.graphs == {} and calls == [1, 1]
    assert streams == ["the stream"]  # the thread is put back on the stream it was on
    assert graphs.run(*step(1)) is None and calls == [1, 1]  # that size is not tried again
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per engine, not one per batch size
        for batch in range(2, MAX_FAILED_BATCHES + 1):
            graphs.run(*step(batch))
            assert graphs.run(*step(batch)) is None
    assert sorted(graphs.failed) == list(range(1, MAX_FAILED_BATCHES + 1))
    assert graphs.off_reason is not None and graphs.off_reason.startswith(
        f"{MAX_FAILED_BATCHES} batch sizes failed")
    assert graphs.run(*step(9)) is None and graphs.run(*step(9)) is None
    assert 9 not in graphs.failed  # capturing is off: nothing more is tried


def test_a_capture_failure_names_the_error_and_the_kernelbay_line_it_came_from() -> None:
    from kernelbay.engine.transfer import upload_into

    with pytest.raises(RuntimeError) as info:
        upload_into(torch.zeros(2), [[1.0, 2.0, 3.0]])
    reason = capture_failure(info.value)
    assert reason.startswith(type(info.value).__name__ + ": ")
    assert re.search(r" \(at kernelbay/engine/transfer\.py:\d+ in upload_into\)$", reason), reason
    # the cause is reported, not the error that ending the invalidated capture raised
    ended = RuntimeError("capture invalidated")
    ended.__context__ = ValueError("read a device value\nsecond line")
    assert capture_failure(ended) == "ValueError: read a device value"


def test_table_width_is_the_needed_pages_rounded_to_a_power_of_two_within_capacity() -> None:
    assert [table_width(n, 16, 100) for n in (1, 16, 17, 33, 64, 65, 129)] == [
        1, 1, 2, 4, 4, 8, 16]
    assert table_width(1000, 16, 40) == 40 and table_width(0, 16, 5) == 1


def test_graph_steps_give_the_eager_tokens_through_the_static_buffers(tmp_path: Any) -> None:
    """The whole engine through the graph path on the CPU (captures and replays simulated):
    the static buffers, the widths growing in powers of two as the contexts grow, the key
    bound and the missing host lengths give the eager tokens."""
    path = save_tiny(str(tmp_path), "llama")
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    eager = LLM(path, dtype="float32", registry=CORE_ONLY)
    want = [o.token_ids for o in eager.generate(prompts, params)]
    llm = LLM(path, dtype="float32", registry=CORE_ONLY)
    graphs = simulated_graphs(llm)
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert graphs.failed == {} and graphs.replays > 30
    capacity = -(-(5 + 40) // llm.cache.page_size)
    widths = sorted({w for _, w in graphs.graphs})
    assert len(widths) > 1, widths
    assert all(w <= capacity and (w & (w - 1) == 0 or w == capacity) for w in widths), widths


def test_padded_graph_steps_give_the_eager_tokens(tmp_path: Any) -> None:
    """Five sequences finishing one after another: steps of 5 run in the graph of 6 (a pad
    row on the scratch page), then 4, 3, 2 and 1 in their own, with the eager tokens."""
    path = save_tiny(str(tmp_path), "llama")
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14], [15, 16], [17]]
    params = [SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True) for i in range(5)]
    eager = LLM(path, dtype="float32", registry=CORE_ONLY)
    want = [o.token_ids for o in eager.generate(prompts, params)]
    llm = LLM(path, dtype="float32", registry=CORE_ONLY)
    graphs = simulated_graphs(llm)
    assert graphs.scratch_page == llm.cache.scratch_page == llm.cache.allocator.num_pages
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert graphs.failed == {} and {b for b, _ in graphs.graphs} == {6, 4, 3, 2, 1}


def test_the_demo_moe_and_mla_model_decodes_in_graphs_without_host_reads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The DeepSeek-V3-shaped demo (MLA attention, routed experts) through the graph path on
    the CPU, its captures simulated (any host read raises): every expert runs on every token
    there, and the tokens are the eager ones. With fewer experts allowed per routed one, the
    smallest batch is refused (eagerly, without a warning) while larger ones are captured."""
    from kernelbay.demo import demo_path
    from kernelbay.layers import moe

    prompts = ["def main(", "import os\n", "class A:", "x = 1"]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    eager = LLM(demo_path(), dtype="float32", registry=CORE_ONLY)
    want = [o.token_ids for o in eager.generate(prompts, params)]
    llm = LLM(demo_path(), dtype="float32", registry=CORE_ONLY)
    graphs = simulated_graphs(llm)
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert graphs.failed == {} and graphs.replays > 5
    # 8 experts, top-2: one token is 2 routed evaluations; 2x allows 4 < 8
    monkeypatch.setattr(moe, "CAPTURED_EXPERTS_PER_ROUTED", 2)
    llm = LLM(demo_path(), dtype="float32", registry=CORE_ONLY)
    graphs = simulated_graphs(llm)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a refusal is by design: no warning
        got = [o.token_ids for o in llm.generate(prompts[:1], params)]
    assert got == want[:1] and graphs.failed == {} and graphs.graphs == {}
    assert re.fullmatch(r"CaptureRefused: combine_experts: a captured step would read all 8 "
                        r"experts .* \(at kernelbay/layers/moe.py:\d+ in _every_expert\)",
                        graphs.refused[1]), graphs.refused
    assert [o.token_ids for o in llm.generate(prompts[:2], params)] == want[:2]
    assert set(graphs.refused) == {1} and {b for b, _ in graphs.graphs} == {2}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_replayed_decode_gives_the_eager_tokens_on_gpu(tmp_path: Any,
                                                             dtype: str) -> None:
    path = save_tiny(str(tmp_path), "llama")
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14], [3] * 40]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    eager = LLM(path, device="cuda", dtype=dtype, registry=CORE_ONLY, cuda_graphs=False)
    graphed = LLM(path, device="cuda", dtype=dtype, registry=CORE_ONLY)
    want = [o.token_ids for o in eager.generate(prompts, params)]
    got = [o.token_ids for o in graphed.generate(prompts, params)]
    assert got == want
    graphs = graphed.runner.graphs
    assert graphs is not None and graphs.off_reason is None and graphs.replays > 10
    # sampled steps too (per-row parameters go up without a sync)
    sampled = [SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=s)
               for s in range(4)]
    assert [o.token_ids for o in graphed.generate(prompts, sampled)] == [
        o.token_ids for o in eager.generate(prompts, sampled)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_padded_graph_steps_give_the_eager_tokens_on_gpu(tmp_path: Any) -> None:
    """Real captures: steps of 5 sequences replayed in the graph of 6, the pad row on the
    scratch page (float32: the extra row changes no other row's sums)."""
    path = save_tiny(str(tmp_path), "llama")
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14], [15, 16], [3] * 40]
    params = [SamplingParams(max_tokens=8 + 4 * i, ignore_eos=True) for i in range(5)]
    eager = LLM(path, device="cuda", dtype="float32", registry=CORE_ONLY, cuda_graphs=False)
    graphed = LLM(path, device="cuda", dtype="float32", registry=CORE_ONLY)
    want = [o.token_ids for o in eager.generate(prompts, params)]
    assert [o.token_ids for o in graphed.generate(prompts, params)] == want
    graphs = graphed.runner.graphs
    assert graphs is not None and graphs.failed == {} and (6, 4) in graphs.graphs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_backend_that_syncs_falls_back_to_eager_on_gpu(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from kernelbay.layers.torch_attention import TorchPagedAttention

    forward = TorchPagedAttention.forward

    def syncing(self: Any, query: torch.Tensor, cache: torch.Tensor, metadata: Any,
                scale: float) -> torch.Tensor:
        metadata.seq_lens.tolist()  # a device read: not allowed while capturing
        return forward(self, query, cache, metadata, scale)

    monkeypatch.setattr(TorchPagedAttention, "forward", syncing)
    path = save_tiny(str(tmp_path), "llama")
    prompts = [[5, 6, 7], [8, 9]]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    want = [o.token_ids for o in LLM(path, device="cuda", dtype="float32", registry=CORE_ONLY,
                                     cuda_graphs=False).generate(prompts, params)]
    graphed = LLM(path, device="cuda", dtype="float32", registry=CORE_ONLY)
    with pytest.warns(RuntimeWarning, match="decode steps of 2 sequences run eagerly"):
        got = [o.token_ids for o in graphed.generate(prompts, params)]
    assert got == want
    assert graphed.runner.graphs is not None and set(graphed.runner.graphs.failed) == {2}
    assert [o.token_ids for o in graphed.generate(prompts, params)] == want
