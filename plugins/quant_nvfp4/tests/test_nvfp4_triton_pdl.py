"""The Triton fragment-order kernel of ``nvfp4-triton`` (``triton_halfword``, the M <= 16
``pt-*`` configs) built to wait and release, and in a CUDA graph a programmatic dependent of the
layer before (the default; ``KERNELBAY_PDL=0`` turns it off, ``kernelbay.triton_pdl``): chained
layers give the bits of plain launches."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernelbay_quant_nvfp4.triton_halfword import nvfp4_linear_hw
from nvfp4_triton_helpers import check_programmatic_chain


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

    from kernelbay import triton_pdl

    monkeypatch.setenv("KERNELBAY_PDL", "1")
    assert triton_pdl.enabled(torch.device("cuda"))  # else the chain would test plain launches
    check_programmatic_chain(monkeypatch, run, m)


def test_switching_the_interpreter_rebuilds_the_grid_helpers() -> None:
    """A process that switches ``TRITON_INTERPRET`` off after building the kernels under the
    interpreter gets compiled grid-dependency helpers in both kernel modules (the split-K
    sum and the tiles kernel call them), not the interpreter's."""
    import subprocess
    import sys

    code = """
import os
os.environ["TRITON_INTERPRET"] = "1"
import triton
from kernelbay_quant_nvfp4 import triton_halfword
triton_halfword.hw_kernel()
os.environ["TRITON_INTERPRET"] = "0"
triton_halfword.hw_kernel()
import sys
from triton.runtime.jit import JITFunction
kernels = sys.modules["kernelbay_quant_nvfp4.triton_kernels"]
halfword = sys.modules["kernelbay_quant_nvfp4.triton_halfword"]
for module in (kernels, halfword):
    for name in ("grid_wait", "grid_release"):
        helper = getattr(module, name)
        assert type(helper) is JITFunction, (module.__name__, name, type(helper))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
