"""``nvfp4-triton`` against the reference (``kernelbay.formats.dequantize_nvfp4`` + matmul in
float32): in Triton's interpreter on CPU (tiny ragged shapes, ``triton_interpret_cases.py`` in a child
process), and on CUDA (``gpu``).

Tolerance: the kernel rounds each dequantized weight to the activation dtype (as
``nvfp4-emulation`` does) and rounds its fp32 sum to the output dtype, while the reference
keeps both in float32. Each rounding moves a value by at most one unit roundoff ``u``
relative, so ``|y - y_ref| <= 2u * (|x| @ |W|^T) + (fp32 summation error)``; the test allows
``4u * (|x| @ |W|^T) + 1e-6``, with ``u = 2^-7`` for bf16 (Triton's interpreter truncates
instead of rounding to nearest, which doubles bf16's 2^-8) and 2^-10 for fp16. A wrong
nibble, scale or K offset changes single products by whole steps of the E2M1 grid and
breaks this bound.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from kernelbay.device import parse_device
from kernelbay.formats import dequantize_nvfp4
from kernelbay.requests import LinearRequest
from kernelbay_quant_nvfp4.linear_triton import Nvfp4TritonLinear
from kernelbay_quant_nvfp4.schemes import nvfp4_scheme
from kernelbay_quant_nvfp4.triton_configs import CANDIDATES, KernelConfig, layout_of
from nvfp4_triton_helpers import (
    check_close,
    edge_scales,
    every_code_and_scale,
    make_layer,
    nvfp4_weights,
    run_on,
)

W4A16 = nvfp4_scheme("modelopt", w4a4=False)
W4A4 = nvfp4_scheme("modelopt", w4a4=True)


@pytest.mark.triton_interpreter
def test_interpreter_cases() -> None:
    """Run ``triton_interpret_cases.py`` under Triton's interpreter in a child process (the
    interpreter is chosen when ``triton.jit`` runs, and switching it inside one process
    leaves triton's patched language half-applied)."""
    pytest.importorskip("triton")
    here = os.path.dirname(__file__)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           os.path.join(here, "triton_interpret_cases.py")],
                          env=env, cwd=here, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout


def test_can_implement_reasons() -> None:
    req = LinearRequest(4096, 4096, W4A4, "bfloat16")
    ok = Nvfp4TritonLinear.can_implement(req, parse_device("sm_90"))
    assert ok.accepted and "input_scale is not used" in ok.describe()
    assert Nvfp4TritonLinear.can_implement(LinearRequest(64, 32, W4A16), parse_device("sm_80"))
    cases = {
        "compute capability >= 8.0": (req, "sm_75"),
        "CUDA (compute capability >= 8.0) or ROCm GPU": (req, "cpu"),
        "activation dtype": (LinearRequest(4096, 4096, W4A16, "float32"), "sm_90"),
        "K=4104 is not a multiple": (LinearRequest(4104, 64, W4A16), "sm_90"),
    }
    for needle, (request, spec) in cases.items():
        verdict = Nvfp4TritonLinear.can_implement(request, parse_device(spec))
        assert not verdict.accepted and needle in verdict.reason, verdict.reason
    moe = LinearRequest(64, 32, W4A16, num_experts=4)
    assert not Nvfp4TritonLinear.can_implement(moe, parse_device("sm_90")).applicable


def test_nan_scale_rejected_naming_the_tensor() -> None:
    tensors = nvfp4_weights(16, 32, torch.Generator().manual_seed(0))
    tensors["weight_scale"].view(torch.uint8)[3, 1] = 0x7F  # E4M3 NaN
    method = Nvfp4TritonLinear(LinearRequest(32, 16, W4A16))
    with pytest.raises(ValueError, match="weight_scale has 1 NaN/Inf"):
        make_layer(method, tensors)


def ragged_k(config: KernelConfig) -> int:
    """A K that is whole NVFP4 blocks but not whole K tiles: 3088 = 193 blocks, or 3104 = 97
    groups of 32 for the fragment-order words (which need K a multiple of 32), or 3200 = 25
    chunks of 128 for the CUDA GEMV and the wgmma GEMM (which need whole chunks; 25 do not
    split evenly over the GEMV's warps)."""
    if config.path in ("cuda", "cuda-tiles", "tiles", "cuda-wgmma", "cuda-bulk"):
        return 3200
    return 3104 if config.path == "fragment" else 3088


@pytest.mark.gpu
@pytest.mark.parametrize("config", CANDIDATES, ids=lambda c: c.name)
def test_cuda_every_config_matches_reference(config: KernelConfig) -> None:
    """Every kernel config the benchmark may pick (the PTX decode included), ragged N and K."""
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0")

    # the tiles layout groups whole 16-row tiles (63 here: an odd count)
    n, k = 1008 if layout_of(config) == "tiles" else 1000, ragged_k(config)
    gen = torch.Generator().manual_seed(n ^ k)
    tensors = {name: t.cuda() for name, t in nvfp4_weights(n, k, gen).items()}
    edge_scales(tensors)
    w = dequantize_nvfp4(tensors["weight"], tensors["weight_scale"], tensors["weight_scale_2"])
    bias = torch.randn(n, generator=gen).bfloat16().cuda()
    for m in (1, 5, 16, 64, 257):
        x = torch.randn(m, k, generator=gen).bfloat16().cuda()
        got = run_on(config, x, tensors, bias)
        check_close(got, x, w, bias)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "k"), [(4096, 4096), (8192, 28672)])
def test_cuda_method_matches_reference(dtype: torch.dtype, n: int, k: int) -> None:
    """The method with its default config table, bench-sized shapes."""
    gen = torch.Generator().manual_seed(n ^ k)
    tensors = {name: t.cuda() for name, t in nvfp4_weights(n, k, gen).items()}
    edge_scales(tensors)
    w = dequantize_nvfp4(tensors["weight"], tensors["weight_scale"], tensors["weight_scale_2"])
    method = Nvfp4TritonLinear(LinearRequest(k, n, W4A16, str(dtype)[6:]))
    layer = make_layer(method, tensors)
    for m in (1, 4, 16, 64, 256):
        x = torch.randn(m, k, generator=gen).to(dtype).cuda()
        check_close(method.apply(layer, x), x, w, None)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [c for c in CANDIDATES if c.path != "dequant"], ids=lambda c: c.name)
def test_cuda_halfword_fp16_matches_reference(config: KernelConfig) -> None:
    """The halfword kernels with fp16 activations (decoded bf16 tile converted to fp16,
    exact), ragged N and K, edge block scales."""

    n, k = 1008 if layout_of(config) == "tiles" else 1000, ragged_k(config)
    gen = torch.Generator().manual_seed(n + k)
    tensors = {name: t.cuda() for name, t in nvfp4_weights(n, k, gen).items()}
    edge_scales(tensors)
    w = dequantize_nvfp4(tensors["weight"], tensors["weight_scale"], tensors["weight_scale_2"])
    bias = torch.randn(n, generator=gen).half().cuda()
    for m in (1, 16, 64, 257):
        x = torch.randn(m, k, generator=gen).half().cuda()
        got = run_on(config, x, tensors, bias)
        check_close(got, x, w, bias)


_ONE_PER_KERNEL = ("hw-16x64x512-s2", "hw-64x128x128", "pw-16x64x256-p3", "pr-16x128x128",
                   "pr-64x128x128", "pf-16x64x256-p3", "pf-64x128x128", "ct-default")


@pytest.mark.gpu
@pytest.mark.parametrize("config", [c for c in CANDIDATES if c.name in _ONE_PER_KERNEL],
                         ids=lambda c: c.name)
def test_cuda_ptx_decodes_every_code_and_scale(config: KernelConfig) -> None:
    """The PTX decode of every E2M1 code under every finite E4M3 block scale, one exact
    product per output: equal to the reference rounded to bf16, bit for bit (a split-K and
    an unsplit config of the halfword decode, and the word decode: the PTX is the same)."""

    tensors, eye = every_code_and_scale()
    tensors = {name: t.cuda() for name, t in tensors.items()}
    w = dequantize_nvfp4(tensors["weight"], tensors["weight_scale"], tensors["weight_scale_2"])
    got = run_on(config, eye.cuda(), tensors, None)
    assert torch.equal(got, w.T.to(torch.bfloat16))


def test_one_config_per_kernel_is_a_candidate() -> None:
    """The GPU decode test's picks exist (a renamed candidate must not silently drop one)."""
    assert {c.name for c in CANDIDATES} >= set(_ONE_PER_KERNEL)
