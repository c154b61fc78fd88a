"""Which kernel the symmetric-memory all-reduce picks per message (no GPU needed: the
choice depends on the size, dtype and layout only, so a stand-in tensor describes it)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from kernelbay import CollectiveRequest
from kernelbay_tp_collectives.two_shot import (
    DEFAULT_MAX_BYTES,
    ONE_SHOT_MAX_BYTES,
    SymmMemTwoShotAllReduce,
    has_op,
)


@dataclass
class _Tensor:
    """The attributes ``path`` reads from a CUDA tensor."""

    n: int
    dtype: torch.dtype = torch.bfloat16
    is_cuda: bool = True
    contiguous: bool = True

    def numel(self) -> int:
        return self.n

    def element_size(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    def is_contiguous(self) -> bool:
        return self.contiguous


def _collective(world: int = 2) -> SymmMemTwoShotAllReduce:
    return SymmMemTwoShotAllReduce(CollectiveRequest("all_reduce", world, "bfloat16", "nccl"))


def test_priority_ranks_above_the_nccl_reference() -> None:
    # it routes sizes where NCCL measured faster to NCCL itself, so it may lead
    from kernelbay.layers.torch_collectives import TorchDistributedCollective

    assert SymmMemTwoShotAllReduce.priority > TorchDistributedCollective.priority


@pytest.mark.skipif(not has_op("one_shot_all_reduce_copy_out"),
                    reason="this torch has no one-shot copy kernel")
@pytest.mark.parametrize("nbytes, expected", [
    (16, "one_shot"), (ONE_SHOT_MAX_BYTES, "one_shot"), (ONE_SHOT_MAX_BYTES + 4, "two_shot"),
    (DEFAULT_MAX_BYTES, "two_shot"), (DEFAULT_MAX_BYTES + 64, "nccl"),
])
def test_size_picks_the_kernel(nbytes: int, expected: str) -> None:
    x = _Tensor(nbytes // 2)
    assert _collective().path(x) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize("x", [_Tensor(8, is_cuda=False), _Tensor(8, contiguous=False),
                               _Tensor(8, dtype=torch.float16), _Tensor(7), _Tensor(0)],
                         ids=["cpu", "strided", "fp16", "odd-bytes", "empty"])
def test_ineligible_inputs_go_to_nccl(x: _Tensor) -> None:
    assert _collective().path(x) == "nccl"  # type: ignore[arg-type]


def test_one_rank_and_a_broken_buffer_go_to_nccl() -> None:
    one = SymmMemTwoShotAllReduce(CollectiveRequest("all_reduce", 1, "bfloat16", "nccl"))
    assert one.path(_Tensor(1024)) == "nccl"  # type: ignore[arg-type]
    broken = _collective()
    broken._broken = True
    assert broken.path(_Tensor(1024)) == "nccl"  # type: ignore[arg-type]


def test_in_buffer_reduce_needs_the_buffer_and_whole_vectors() -> None:
    c = _collective()
    with pytest.raises(RuntimeError, match="before the buffer exists"):
        c.all_reduce_in_buffer(64, torch.bfloat16)
    c._buffer = object()  # type: ignore[assignment]
    with pytest.raises(ValueError, match=r"of 34 bytes; valid: a multiple of 32 up to"):
        c.all_reduce_in_buffer(17, torch.bfloat16)
