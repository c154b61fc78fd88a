"""Each token's routed slot rows added up (``kernelbay.layers.slot_sum``): the tensor path
against float32 additions made one by one in numpy, the Triton kernel (in the interpreter,
and on a GPU) against the tensor path bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernelbay.layers.slot_sum import sum_slots


def _numpy_sum(y: torch.Tensor, top_k: int) -> np.ndarray:
    """float32 left-to-right sums, one numpy addition per slot (an independent reference)."""
    rows = y.numpy().reshape(y.shape[0] // top_k, top_k, y.shape[1])
    out = rows[:, 0].copy()
    with np.errstate(over="ignore", invalid="ignore"):  # the inf and NaN columns
        for k in range(1, top_k):
            out = (out + rows[:, k]).astype(np.float32)
    return out


def _awkward(tokens: int, top_k: int, n: int, seed: int) -> torch.Tensor:
    """Random rows with the values that expose an addition order or a rounding: magnitudes
    from 2^-140 (subnormal) to 2^126, cancelling pairs, zeros of both signs, a NaN and
    sums that overflow."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(tokens * top_k, n, generator=g) * torch.exp2(
        torch.randint(-140, 127, (tokens * top_k, n), generator=g).float())
    if tokens * top_k >= 2 and n >= 8:
        y[1, :4] = -y[0, :4]  # exact cancellation
        y[0, 4], y[1, 4] = 0.0, -0.0
        y[0, 5] = float("nan")
        y[:, 6] = 3.0e38  # overflows to inf from two slots on
        y[:, 7] = 1.0 + 2.0**-23  # the roundings of a long sum show
    if n >= 10:  # sums halfway between two bf16 values: to even, once down, once up
        y[:, 8:10] = 0.0
        y[::top_k, 8], y[::top_k, 9] = 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8
    return y


@pytest.mark.parametrize("tokens, top_k, n", [(1, 8, 33), (5, 3, 1030), (4, 1, 9), (0, 2, 8),
                                              (3, 2, 0)])
def test_tensor_path_adds_each_tokens_slots_left_to_right(tokens: int, top_k: int,
                                                           n: int) -> None:
    y = _awkward(tokens, top_k, n, seed=tokens + n)
    want = _numpy_sum(y, top_k)
    got = sum_slots(y, top_k, torch.float32, kernel="torch")
    assert got.shape == (tokens, n) and got.dtype == torch.float32
    assert np.array_equal(got.numpy(), want, equal_nan=True)
    for dtype in (torch.bfloat16, torch.float16):  # one rounding of the float32 sum
        rounded = sum_slots(y, top_k, dtype, kernel="torch")
        assert torch.equal(rounded.isnan(), torch.from_numpy(want).isnan())
        ok = ~rounded.isnan()
        assert torch.equal(rounded[ok], torch.from_numpy(want).to(dtype)[ok])


def test_errors_name_the_argument_and_what_is_expected() -> None:
    y = torch.zeros(6, 4)
    with pytest.raises(ValueError, match=r"kernel='cuda'; valid: \('auto', 'torch', 'triton'\)"):
        sum_slots(y, 2, torch.bfloat16, kernel="cuda")
    with pytest.raises(ValueError, match=r"y must be float32 \[tokens \* top_k, N\] with "
                                         r"top_k=4, got torch.float32 \(6, 4\)"):
        sum_slots(y, 4, torch.bfloat16)
    with pytest.raises(ValueError, match=r"got torch.bfloat16 \(6, 4\)"):
        sum_slots(y.bfloat16(), 2, torch.bfloat16)
    with pytest.raises(ValueError, match="top_k=0 must be >= 1"):
        sum_slots(y, 0, torch.bfloat16)
    with pytest.raises(ValueError, match=r"out_dtype=torch.int32; valid: \('torch.float32', "
                                         r"'torch.bfloat16', 'torch.float16'\)"):
        sum_slots(y, 2, torch.int32)


_TRITON_CASES = """
import torch
from kernelbay.layers.slot_sum import sum_slots
import test_slot_sum as t

for tokens, top_k, n in [(1, 8, 33), (5, 3, 1030), (4, 1, 9), (0, 2, 8), (2, 2, 2049)]:
    y = t._awkward(tokens, top_k, n, seed=7 * tokens + n)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        want = sum_slots(y, top_k, dtype, kernel="torch")
        got = sum_slots(y, top_k, dtype, kernel="triton")
        same = torch.equal(got.isnan(), want.isnan()) and torch.equal(
            got[~got.isnan()].view(torch.int16 if dtype != torch.float32 else torch.int32),
            want[~want.isnan()].view(torch.int16 if dtype != torch.float32 else torch.int32))
        assert same, (tokens, top_k, n, dtype, got, want)
# a strided view is summed as its values
y = t._awkward(3, 2, 40, seed=1)[:, ::2]
got = sum_slots(y, 2, torch.float32, kernel="triton")
want = sum_slots(y, 2, torch.float32, kernel="torch")
nan = want.isnan()
assert torch.equal(got.isnan(), nan)
assert torch.equal(got.view(torch.int32)[~nan], want.view(torch.int32)[~nan])
print("ok")
"""


def test_the_triton_kernel_gives_the_tensor_paths_bits() -> None:
    """In Triton's interpreter (a child process: the interpreter is chosen when ``triton.jit``
    decorates), float32 / bf16 / fp16 out, ragged widths, every awkward value, bf16 ties;
    every value compared by its bits (+0 and -0 apart), NaNs by position."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys

    from kernelbay.testing.interpreter import triton_interpreter_problem

    problem = triton_interpreter_problem()
    if problem:
        pytest.skip(problem)
    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-c", _TRITON_CASES],
                          env={**os.environ, "TRITON_INTERPRET": "1",
                               "PYTHONPATH": os.pathsep.join(
                                   [here, os.environ.get("PYTHONPATH", "")])},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("tokens, top_k, n", [(1, 8, 7168), (37, 8, 7168), (16, 6, 2050)])
def test_gpu_kernel_gives_the_tensor_paths_bits(tokens: int, top_k: int, n: int) -> None:
    y = _awkward(tokens, top_k, n, seed=n).cuda()
    for dtype, ints in ((torch.float32, torch.int32), (torch.bfloat16, torch.int16)):
        want = sum_slots(y, top_k, dtype, kernel="torch")
        for kernel in ("triton", "auto"):
            got = sum_slots(y, top_k, dtype, kernel=kernel)
            nan = want.isnan()
            assert torch.equal(got.isnan(), nan)  # NaN payloads are each conversion's own
            assert torch.equal(got.view(ints)[~nan], want.view(ints)[~nan])  # -0 kept


def test_the_triton_kernel_compiles_for_sm90_as_a_programmatic_launch() -> None:
    """Compiled for sm_90 on the CPU (ptxas, no GPU) as CUDA builds it there: waiting for the
    kernel before it and releasing the next (``kernelbay.triton_pdl``) between its last load
    and its store, where the benchmark found the release fastest."""
    pytest.importorskip("triton")
    from kernelbay.layers.slot_sum_triton import RELEASE_POINTS, _sum_slots_kernel
    from kernelbay.testing.triton_compile import compile_for_cuda
    from kernelbay.triton_pdl import SUPPORTED

    values = {"TOP_K": 8, "BLOCK": 1024, "OUT_BF16_BITS": False, "PDL": SUPPORTED,
              "RELEASE": RELEASE_POINTS.index("loads")}
    compiled = compile_for_cuda(_sum_slots_kernel, values,
                                {"y_ptr": "*fp32", "out_ptr": "*bf16"}, num_warps=4)
    ptx = compiled.asm["ptx"]
    assert ("griddepcontrol.wait" in ptx) == SUPPORTED
    if SUPPORTED:
        release = ptx.index("griddepcontrol.launch_dependents")
        assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global")
        assert ptx.rindex("ld.global") < release < ptx.index("st.global")


def test_the_triton_launch_refuses_an_unknown_release_point() -> None:
    pytest.importorskip("triton")
    from kernelbay.layers.slot_sum_triton import sum_slots_triton

    with pytest.raises(ValueError, match=r"release='middle'.*'start', 'loads', 'end'"):
        sum_slots_triton(torch.zeros(8, 4), 8, torch.float32, release="middle")
