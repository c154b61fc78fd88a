"""A CUDA-graph capture simulated on any device: what a decode step does that a real capture
would reject, found on a CPU.

``simulated_capture()`` runs code as if it were being captured; ``simulated_graphs(llm)`` puts
an engine's decode steps on its CUDA-graph path (static buffers, one graph per shape, replays)
with every capture and replay simulated, so a model or backend is checked end to end::

    llm = LLM(path, device="cpu")
    graphs = simulated_graphs(llm)
    tokens = llm.generate(prompts, params)   # the eager tokens, if the backend is capturable
    assert graphs.failed == {}                # else: {batch size: what broke the capture}
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernelbay.capture import capturable_paths, kernelbay_line
from kernelbay.engine.graphs import DecodeGraphs

__all__ = ["CaptureViolation", "simulated_capture", "simulated_graphs"]

# Ops that read a device value on the host (or wait for one to size their output).
_HOST_READS = frozenset({"_local_scalar_dense", "nonzero", "_unique", "_unique2", "unique_dim",
                         "unique_consecutive", "masked_select", "equal"})


class CaptureViolation(RuntimeError):
    """An op a CUDA graph capture cannot hold, run inside ``simulated_capture``."""


def _violation(what: str) -> CaptureViolation:
    where = kernelbay_line(traceback.extract_stack())
    return CaptureViolation(f"{what} inside a CUDA graph capture{f' at {where}' if where else ''}"
                            f": it reads a device value on the host (or copies from pageable "
                            f"host memory)")


class _RejectHostReads(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        name = func.__name__.split(".")[0]
        kwargs = kwargs or {}
        if name in _HOST_READS or _sizes_from_values(name, args, kwargs):
            raise _violation(f"aten.{func.__name__}")
        return func(*args, **kwargs)


def _sizes_from_values(name: str, args: Any, kwargs: Any) -> bool:
    """Ops whose output size comes from tensor values: boolean-mask indexing, and
    ``repeat_interleave`` of tensor counts without ``output_size``."""
    if name in ("index", "index_put", "index_put_"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)
    if name == "repeat_interleave":
        counts = args[1] if len(args) > 1 else args[0] if args else kwargs.get("repeats")
        return isinstance(counts, torch.Tensor) and kwargs.get("output_size") is None
    return False


@contextlib.contextmanager
def simulated_capture() -> Iterator[None]:
    """Run code as if a CUDA graph were being captured, on any device:
    ``kernelbay.capture.is_capturing`` is true, and what a capture cannot hold raises
    ``CaptureViolation`` naming it and the kernelbay line that ran it: a host read
    (``item``, ``tolist``, ``bool`` of a tensor, ``nonzero``, ``unique``, boolean-mask
    indexing, ``repeat_interleave`` without ``output_size``), and Python data made into a
    device tensor (``torch.tensor`` / ``torch.as_tensor`` with a ``device``,
    ``Tensor.new_tensor``: a copy from pageable host memory on a GPU). Not thread-safe: those
    four functions are patched while it runs, for every thread."""
    real = torch.Tensor.tolist, torch.tensor, torch.as_tensor, torch.Tensor.new_tensor

    def tolist(self: torch.Tensor) -> Any:
        raise _violation("Tensor.tolist")

    def made_on(make: Any, name: str) -> Any:
        def made(data: Any, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("device") is not None and not isinstance(data, torch.Tensor):
                raise _violation(f"torch.{name}(<Python data>, device=...)")
            return make(data, *args, **kwargs)
        return made

    torch.Tensor.tolist = tolist  # type: ignore[method-assign,assignment]
    torch.tensor = made_on(real[1], "tensor")
    torch.as_tensor = made_on(real[2], "as_tensor")

    def new_tensor(self: torch.Tensor, data: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(data, torch.Tensor):  # made on the tensor's device
            raise _violation("Tensor.new_tensor(<Python data>)")
        return real[3](self, data, *args, **kwargs)

    torch.Tensor.new_tensor = new_tensor  # type: ignore[method-assign,assignment]
    try:
        with capturable_paths(), _RejectHostReads():  # type: ignore[no-untyped-call]
            yield
    finally:
        torch.Tensor.tolist, torch.Tensor.new_tensor = real[0], real[3]  # type: ignore[method-assign]
        torch.tensor, torch.as_tensor = real[1], real[2]


class _Rerun:
    """A simulated graph: a replay runs the captured step again (under a simulated capture)
    and writes its output where the capture's output lives, as a CUDA graph's replay does."""

    def __init__(self, step: Callable[[], torch.Tensor], out: torch.Tensor) -> None:
        self.step, self.out = step, out

    def replay(self) -> None:
        with torch.inference_mode(), simulated_capture():
            self.out.copy_(self.step())

    def pool(self) -> None:
        return None


def simulated_graphs(llm: Any) -> DecodeGraphs:
    """Give ``llm`` (a ``kernelbay.engine.LLM``, any device) CUDA-graph decode steps whose
    captures and replays are simulated: a capture runs the step once under
    ``simulated_capture`` and then puts back the KV caches it wrote (a real capture leaves no
    trace either); a replay runs it again under ``simulated_capture``. Returns the engine's
    new ``DecodeGraphs`` (see its ``failed``, ``graphs`` and ``replays``)."""
    caches = llm.cache.caches

    def record(step: Callable[[], torch.Tensor], pool: Any) -> tuple[_Rerun, torch.Tensor]:
        del pool
        saved = [c.clone() for c in caches]
        with torch.inference_mode(), simulated_capture():
            try:
                out = step()
            finally:  # a failed capture leaves no trace either
                for cache, old in zip(caches, saved, strict=True):
                    cache.copy_(old)
        return _Rerun(step, out), out

    graphs = DecodeGraphs(llm.model, caches, llm.cache.page_size, llm.device, record=record,
                          scratch_page=llm.cache.scratch_page)
    llm.runner.graphs = graphs
    return graphs
