"""The Triton fragment-order kernel of ``nvfp4-triton`` (``triton_halfword``, the M <= 16
``pt-*`` configs) launched as programmatic dependents (``KERNELBAY_PDL=1``,
``kernelbay.triton_pdl``): chained layers give the bits of plain launches."""

from __future__ import annotations

import pytest
import torch
from kernelbay_quant_nvfp4.triton_halfword import nvfp4_linear_hw
from nvfp4_triton_helpers import check_programmatic_chain

pytest.importorskip("triton")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available()
                    or torch.cuda.get_device_capability() < (9, 0),
                    reason="programmatic launches need compute capability 9.0+")
@pytest.mark.parametrize("m,split_k", [(1, 4), (4, 1), (16, 4)])
def test_triton_tiles_kernel_programmatic_launches_wait(
        m: int, split_k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiles-layout kernel and its split-K sum read activations and partials only once
    the kernel before them has finished."""
    def run(x: torch.Tensor, words: torch.Tensor, codes: torch.Tensor,
            scale: torch.Tensor) -> torch.Tensor:
        return nvfp4_linear_hw(x, words, codes, scale, None, block_m=16, block_n=64,
                               block_k=256, split_k=split_k, num_warps=4, num_stages=3,
                               tiled=True)

    check_programmatic_chain(monkeypatch, run, m)
