"""Target and drafter compiled with torch.compile keep their compiled artifacts apart."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from kernelbay.engine.speculative import compile_tagged
from torch import nn


class Block(nn.Module):
    """A tiny stand-in for a model: the same class serves as 'target' and 'drafter', the
    case where sharing a code object would make the two collide."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(x)) * 2


def _recording_backend(seen: list[tuple[str, str | None]]) -> Any:
    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        # Runs at compile time: the cache folder in force is the one artifacts would use.
        seen.append((gm.__class__.__name__, os.environ.get("TORCHINDUCTOR_CACHE_DIR")))
        return gm.forward

    return backend


def test_target_and_drafter_compile_into_separate_namespaces(tmp_path: Any) -> None:
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    torch._dynamo.reset()
    torch.manual_seed(0)
    target, drafter = Block(8), Block(8)
    seen: list[tuple[str, str | None]] = []
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    compiled = {tag: compile_tagged(m, tag, str(tmp_path), backend=_recording_backend(seen))
                for tag, m in (("target", target), ("drafter", drafter))}
    x = torch.randn(3, 8)
    for tag, module in (("target", target), ("drafter", drafter)):
        torch.testing.assert_close(compiled[tag](x), module(x))
    # One compilation per model, each while its own cache folder was in force.
    assert [d for _, d in seen] == [str(tmp_path / "target"), str(tmp_path / "drafter")]
    # Neither tag's folder outlives its call (torch 2.6 sets its own default folder
    # in the environment when it first asks for one, so "unset again" is not the check).
    after = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    assert after == before or after not in {d for _, d in seen}, after
    # Separate code objects, each holding exactly its own dynamo cache entry.
    codes = {tag: c.code for tag, c in compiled.items()}
    assert codes["target"] is not codes["drafter"]
    assert codes["target"].co_name == "forward__target"
    for tag, code in codes.items():
        assert len(_debug_get_cache_entry_list(code)) == 1, tag
    assert not _debug_get_cache_entry_list(Block.forward.__code__)
    # Calling again hits each model's own cache: no recompilation.
    for tag in ("target", "drafter"):
        compiled[tag](torch.randn(3, 8))
    assert len(seen) == 2
    torch._dynamo.reset()


def test_inductor_writes_under_the_tag(tmp_path: Any) -> None:
    pytest.importorskip("torch._inductor")
    if os.environ.get("KERNELBAY_SLOW_COMPILE") != "1":
        pytest.skip("inductor on CPU compiles C++ (slow); set KERNELBAY_SLOW_COMPILE=1")
    torch._dynamo.reset()
    target, drafter = Block(8), Block(8)
    x = torch.randn(3, 8)
    for tag, module in (("target", target), ("drafter", drafter)):
        torch.testing.assert_close(compile_tagged(module, tag, str(tmp_path))(x), module(x))
        assert any(files for _, _, files in os.walk(tmp_path / tag)), tag
    torch._dynamo.reset()


def test_tags_name_code_objects() -> None:
    with pytest.raises(ValueError, match="identifier"):
        compile_tagged(Block(2), "not a tag")
