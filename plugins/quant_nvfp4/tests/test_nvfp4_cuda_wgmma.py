"""The sm_90a wgmma GEMM of ``nvfp4-triton`` for larger batches (``cuda_wgmma``, built by NVRTC)
against the reference (``kernelbay.formats.dequantize_nvfp4`` + matmul in float32), with the
bound of ``test_nvfp4_triton`` (``nvfp4_triton_helpers.check_close``); and, on any machine,
what it refuses and why, and that every build compiles."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from kernelbay.cuda_jit import CudaJitError, compile_cubin, nvrtc_available
from kernelbay.formats import dequantize_nvfp4
from kernelbay_quant_nvfp4.cuda_wgmma import (
    ARCH,
    NARROW,
    WIDE,
    WgmmaConfig,
    build_options,
    config_for_m,
    mma_source,
    nvfp4_wgmma_cuda,
    prefers,
    shared_bytes,
    source,
    split_for,
    stream_plan,
    wgmma_unsupported,
)
from kernelbay_quant_nvfp4.cuda_wgmma import (
    DEFAULT as DEFAULT_BUILD,
)
from kernelbay_quant_nvfp4.linear_triton import layout_tensors
from kernelbay_quant_nvfp4.triton_configs import CANDIDATES
from nvfp4_triton_helpers import (
    check_close,
    check_programmatic_chain,
    cuda_weights,
    edge_scales,
    every_code_and_scale,
    nvfp4_weights,
    strided_extreme_activations,
)

BUILDS = [WgmmaConfig(1, 64, 4, 2), WgmmaConfig(2, 128, 4, 1), WgmmaConfig(1, 256, 3, 1),
          WgmmaConfig(2, 64, 4, 1), WgmmaConfig(1, 16, 6, 3), WgmmaConfig(4, 32, 3, 1),
          WgmmaConfig(3, 48, 3, 1), WgmmaConfig(2, 128, 5, 1), WgmmaConfig(1, 64, 4, 2, 3),
          WgmmaConfig(2, 128, 4, 1, 2), WIDE, replace(WIDE, split=2), WgmmaConfig(4, 64, 4, 1, 4),
          WgmmaConfig(3, 48, 3, 1, 3), replace(NARROW, stream_k=True),
          replace(WIDE, stream_k=True), WgmmaConfig(1, 16, 4, 2, stream_k=True),
          WgmmaConfig(4, 64, 3, 1, 4), WgmmaConfig(4, 64, 3, 1, stream_k=True),
          WgmmaConfig(4, 64, 4, 1, 4, unroll=3), WgmmaConfig(2, 64, 6, 1)]


def _on_sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _stored(tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return layout_tensors(tensors["weight"], tensors["weight_scale"], "tiles")


def test_refusals_name_the_operand() -> None:
    """CPU tensors, and on a GPU: fp16, K not whole chunks, another layout, unaligned rows."""
    gen = torch.Generator().manual_seed(0)
    tensors = nvfp4_weights(32, 256, gen)
    words, codes = _stored(tensors)
    x = torch.randn(40, 256, generator=gen).bfloat16()
    assert "CUDA device" in str(wgmma_unsupported(x, words, codes))
    with pytest.raises(ValueError, match="CUDA device"):
        nvfp4_wgmma_cuda(x, words, codes, tensors["weight_scale_2"], None)
    if not _on_sm90():
        return
    words, codes, xc = words.cuda(), codes.cuda(), x.cuda()
    assert wgmma_unsupported(xc, words, codes) is None
    assert "bfloat16" in str(wgmma_unsupported(xc.half(), words, codes))
    assert "int32 [N/16, 2, 256]" in str(wgmma_unsupported(xc, words.reshape(4, -1), codes))
    assert "multiple of 128" in str(wgmma_unsupported(xc[:, :192], words, codes))
    assert "aligned" in str(wgmma_unsupported(
        torch.zeros(4, 264, dtype=torch.bfloat16, device="cuda")[:, 1:257], words, codes))
    row = torch.zeros(1, 256, dtype=torch.bfloat16, device="cuda")
    assert "do not overlap" in str(wgmma_unsupported(row.expand(8, 256), words, codes))
    assert wgmma_unsupported(row.expand(1, 256), words, codes) is None
    shifted = torch.zeros(words.numel() + 1, dtype=torch.int32, device="cuda")[1:]
    assert "words 16-byte aligned" in str(wgmma_unsupported(
        xc, shifted.view(words.shape), codes))
    assert "scale codes 16-byte aligned on cuda" in str(wgmma_unsupported(xc, words,
                                                                          codes.cpu()))


def test_builds_are_checked_and_fit() -> None:
    """Impossible builds name the field; the defaults fit their CTAs per SM in 227 KB."""
    with pytest.raises(ValueError, match="ntok=20"):
        WgmmaConfig(2, 20).check()
    for spills in (WgmmaConfig(4, 128, 3, 1), WgmmaConfig(2, 128, 4, 2),
                   WgmmaConfig(3, 192, 3, 1)):
        with pytest.raises(ValueError, match="registers per thread"):
            spills.check()
    for build in BUILDS:
        build.check()
    with pytest.raises(ValueError, match="stages=2"):
        WgmmaConfig(1, 64, 2).check()
    with pytest.raises(ValueError, match="split=0"):
        WgmmaConfig(1, 64, 4, 1, 0).check()
    with pytest.raises(ValueError, match="split=2 with stream_k=True"):
        WgmmaConfig(4, 64, 4, 1, 2, stream_k=True).check()
    assert replace(NARROW, stream_k=True).name == "cw-g4n64s4b1sk"
    # turns of the K loop: whole rings where that stays short, three steps otherwise
    assert [WgmmaConfig(1, 64, s).turn for s in (3, 4, 5, 6, 8)] == [3, 12, 3, 6, 3]
    assert replace(NARROW, stream_k=True).turn == 3 and NARROW.turn == 12
    assert WgmmaConfig(1, 64, 4, unroll=3).name == "cw-g1n64s4b1u3"
    with pytest.raises(ValueError, match="unroll=9"):
        WgmmaConfig(1, 64, 3, unroll=9).check()
    with pytest.raises(ValueError, match="unroll=6"):
        WgmmaConfig(1, 64, 6, unroll=6, stream_k=True).check()
    with pytest.raises(ValueError, match="shared memory"):
        WgmmaConfig(2, 256, 5).check()
    for m in (17, 32, 64, 65, 128, 256, 1000):
        for n in (4096, 8192, 28672):
            config = config_for_m(m, n, 8192, 132)
            config.check()
            assert config.min_blocks * shared_bytes(config) <= 227 * 1024
            assert config.ntok >= min(m, 128)


def test_default_build_only_where_its_grid_fills_the_gpu() -> None:
    """From 33 tokens the default build splits K until its CTAs (256 rows by 64 tokens up to
    M = 64, 128 rows by 128 tokens up to 128, by 256 tokens above) number 80% of the SMs (at
    most four ranges of at least four chunks), and serves a layer only if that fills the GPU:
    M = 256 at N = 8192 on 132 SMs is 64 CTAs split in two, at N = 28672 224 unsplit, M = 128
    at N = 8192 64 CTAs split in two, M = 64 at N = 8192 32 CTAs split in four and at
    N = 28672 112 unsplit; M <= 32 and layers too narrow or too short stay with Triton."""
    assert split_for(256, 8192, 8192, 132) == 2 and split_for(256, 28672, 8192, 132) == 1
    assert split_for(128, 28672, 8192, 132) == 1 and split_for(512, 8192, 8192, 132) == 1
    assert split_for(128, 8192, 8192, 132) == 2 and split_for(128, 8192, 28672, 132) == 2
    assert split_for(100, 2048, 8192, 132) == 4 and split_for(128, 8192, 512, 132) == 1
    assert config_for_m(128, 8192, 8192, 132) == replace(DEFAULT_BUILD, split=2)
    assert config_for_m(129, 8192, 8192, 132) == replace(WIDE, split=2)
    assert config_for_m(256, 28672, 8192, 132) == WIDE
    assert config_for_m(64, 8192, 8192, 132) == replace(NARROW, split=4)
    assert config_for_m(33, 28672, 8192, 132) == NARROW
    assert config_for_m(32, 8192, 8192, 132) == WgmmaConfig(1, 32, 4, 2)
    assert prefers(256, 8192, 8192, 132) and prefers(128, 8192, 28672, 132)
    assert prefers(128, 28672, 8192, 132)
    assert prefers(64, 28672, 8192, 132) and prefers(64, 8192, 8192, 132)
    assert not prefers(32, 28672, 8192, 132) and not prefers(128, 8192, 512, 132)
    assert not prefers(64, 4096, 1024, 132)
    assert not prefers(1000, 128, 8192, 132)


def test_stream_plan_on_the_benchmark_shapes() -> None:
    """Stream K gives every SM one CTA of equal work and bounds the segments a CTA writes:
    28672 rows in 256-row tiles (112 tiles of 64 chunks, 54.3 units per CTA) over 132 CTAs
    touch at most two tiles each, as do 32 tiles (15.5 units); 224 tiles (108.6 units) up to
    three; a layer with fewer units than SMs gets a CTA per unit; 13-14 units over tiles of 4
    touch four."""
    assert stream_plan(112, 64, 132) == (132, 2)
    assert stream_plan(224, 64, 132) == (132, 3)
    assert stream_plan(32, 64, 132) == (132, 2)
    assert stream_plan(1, 3, 132) == (3, 1)
    assert stream_plan(10, 4, 3) == (3, 4)
    for row_tiles, chunks, ctas in ((7, 5, 9), (112, 64, 132), (3, 1, 8), (13, 7, 5)):
        units = row_tiles * chunks
        p = min(ctas, units)
        tiles_per_cta = [len({u // chunks for u in range(q * units // p, (q + 1) * units // p)})
                         for q in range(p)]
        assert min(tiles_per_cta) >= 1 and stream_plan(row_tiles, chunks, ctas) == (
            p, max(tiles_per_cta))


def test_mma_wrapper_names_every_accumulator() -> None:
    """The generated wgmma wrapper has one in-out operand per accumulator register, then the
    four A registers, the descriptor and the scale-d flag."""
    text = mma_source(64)
    assert "m64n64k16" in text and text.count('"+f"') == 32
    assert "%36, p, 1, 1, 0" in text and "setp.ne.b32 p, %37, 0" in text


@pytest.mark.skipif(not nvrtc_available(), reason="needs NVRTC (nvidia-cuda-nvrtc)")
def test_every_build_compiles_without_local_memory(tmp_path: Any,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Every build the sweep and the defaults use compiles for sm_90a (NVRTC, no GPU) and
    keeps everything in registers (no local memory, when cuobjdump is installed)."""
    from kernelbay.testing.cubins import cubin_resources

    monkeypatch.setenv("KERNELBAY_CACHE_DIR", str(tmp_path))
    builds = {config_for_m(m, n, 8192, 132) for m in (17, 64, 256) for n in (8192, 28672)}
    builds |= {c.wgmma for c in CANDIDATES if c.wgmma is not None}
    for build in sorted(builds, key=lambda b: b.name):
        cubin = compile_cubin(source(build), "nvfp4_wgmma", ARCH, build_options(build))
        assert cubin[:4] == b"\x7fELF", build.name
        usage = cubin_resources(cubin)
        assert usage is None or ("STACK:0 " in usage and "LOCAL:0 " in usage), (build.name,
                                                                                usage)


@pytest.mark.skipif(not nvrtc_available(), reason="needs NVRTC (nvidia-cuda-nvrtc)")
def test_wgmma_groups_are_not_serialized(tmp_path: Any, monkeypatch: pytest.MonkeyPatch
                                         ) -> None:
    """The point of the kernel: its wgmma groups stay asynchronous. When ptxas finds a register
    of a pending group written, it waits after every HGMMA (each one then completes the
    group and is followed by a wait for zero pending); here each group of four k16 steps
    completes once and the wait leaves one group pending. The stream-K build reads its
    accumulators only between segments, outside the loop that issues the groups (reading them
    inside it serialized every group)."""
    import re

    from kernelbay.testing.cubins import cubin_sass

    monkeypatch.setenv("KERNELBAY_CACHE_DIR", str(tmp_path))
    for build in (DEFAULT_BUILD, WgmmaConfig(1, 64, 4, 2), replace(NARROW, stream_k=True)):
        sass = cubin_sass(compile_cubin(source(build), "nvfp4_wgmma", ARCH,
                                        build_options(build)))
        if sass is None:
            pytest.skip("cuobjdump not found (it comes with triton)")
        steps = re.findall(r"HGMMA\.64x\d+x16\S*[^;]*;", sass)
        closing = [step for step in steps if "gsb0" in step]
        assert steps and len(steps) == 4 * len(closing), build.name
        assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" in sass
        assert "WARPGROUP.DEPBAR.LE gsb0, 0x0" in sass   # only the final drain


@pytest.mark.skipif(not nvrtc_available(), reason="needs NVRTC (nvidia-cuda-nvrtc)")
def test_scale_multipliers_are_operand_swizzles(tmp_path: Any, monkeypatch: pytest.MonkeyPatch
                                                ) -> None:
    """One register holds the multipliers of two blocks (``multipliers2``); each packed
    multiply takes its half through an operand swizzle (``.H0_H0`` / ``.H1_H1``), not through a
    byte permute of its own. If ptxas stopped folding the half move, every multiply would get
    an extra instruction: the wgmma GEMM and the CUDA GEMV both rely on it."""
    import re

    from kernelbay.testing.cubins import cubin_sass
    from kernelbay_quant_nvfp4 import cuda_gemv

    monkeypatch.setenv("KERNELBAY_CACHE_DIR", str(tmp_path))
    cubins = [compile_cubin(source(b), "nvfp4_wgmma", ARCH, build_options(b))
              for b in (DEFAULT_BUILD, NARROW)]
    gemv = cuda_gemv.GemvConfig()
    cubins.append(compile_cubin(cuda_gemv.cuda_source("nvfp4_gemv.cu"), "nvfp4_gemv", "sm_90",
                                cuda_gemv.build_options(gemv)))
    for cubin in cubins:
        sass = cubin_sass(cubin)
        if sass is None:
            pytest.skip("cuobjdump not found (it comes with triton)")
        multiplies = re.findall(r"HMUL2\.BF16_V2[^;]*;", sass)
        assert multiplies
        assert all(re.search(r"\.H([01])_H\1", m) for m in multiplies), multiplies[:4]
        assert any(".H1_H1" in m for m in multiplies)


gpu_sm90 = pytest.mark.skipif(not _on_sm90(), reason="needs compute capability 9.0")


@pytest.mark.gpu
@gpu_sm90
@pytest.mark.parametrize("config", [None, *BUILDS], ids=lambda c: "default" if c is None
                         else c.name)
@pytest.mark.parametrize(("n", "k"), [(16, 128), (208, 384), (48, 640), (1008, 3200),
                                    (304, 8192)])
def test_cuda_wgmma_matches_reference(config: WgmmaConfig | None, n: int, k: int) -> None:
    """Row blocks that do not fill the last CTA, K of 1 to 64 chunks (fewer than the stages
    included, every count modulo the three register sets; split K over 1 to 3 ranges, some
    shorter than the others), token counts that fill no tile exactly and several tiles, bias or none, edge
    block scales."""
    gen = torch.Generator().manual_seed(n * 7 + k)
    tensors = {name: t.cuda() for name, t in nvfp4_weights(n, k, gen).items()}
    edge_scales(tensors)
    w = dequantize_nvfp4(tensors["weight"], tensors["weight_scale"], tensors["weight_scale_2"])
    words, codes = _stored(tensors)
    for m in (1, 17, 64, 100, 256, 300):
        bias = torch.randn(n, generator=gen).bfloat16().cuda() if m % 2 else None
        x = torch.randn(m, k, generator=gen).bfloat16().cuda()
        got = nvfp4_wgmma_cuda(x, words, codes, tensors["weight_scale_2"], bias, config)
        check_close(got, x, w, bias)


@pytest.mark.gpu
@gpu_sm90
def test_cuda_wgmma_strided_activations_and_extremes() -> None:
    """Activation rows with a stride (a slice of a wider tensor), and activations at bf16's
    extremes (huge values, subnormals, zeros): the sums stay within the bound."""
    gen = torch.Generator().manual_seed(11)
    k = 1024
    tensors, w = cuda_weights(208, k, gen)
    words, codes = _stored(tensors)
    x = strided_extreme_activations(70, k, gen)
    for config in (None, WgmmaConfig(2, 128, 4, 1), WIDE):
        got = nvfp4_wgmma_cuda(x, words, codes, tensors["weight_scale_2"], None, config)
        check_close(got, x, w, None)


@pytest.mark.gpu
@gpu_sm90
@pytest.mark.parametrize("config", [WgmmaConfig(1, 64, 4, 2), WgmmaConfig(2, 128, 4, 1), WIDE],
                         ids=lambda c: c.name)
def test_cuda_wgmma_every_code_and_scale_exact(config: WgmmaConfig) -> None:
    """Every E2M1 code under every finite E4M3 block scale, one exact product per output (the
    identity activations, all 256 at once): the reference rounded to bf16, bit for bit."""
    tensors, eye = every_code_and_scale()
    tensors = {name: t.cuda() for name, t in tensors.items()}
    w = dequantize_nvfp4(tensors["weight"], tensors["weight_scale"], tensors["weight_scale_2"])
    words, codes = _stored(tensors)
    got = nvfp4_wgmma_cuda(eye.cuda(), words, codes, tensors["weight_scale_2"], None, config)
    assert torch.equal(got, w.T.to(torch.bfloat16))


@pytest.mark.gpu
@gpu_sm90
@pytest.mark.parametrize("config", [None, NARROW], ids=["default-split", "unsplit"])
def test_cuda_wgmma_programmatic_launches_wait(config: WgmmaConfig | None,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Launched as programmatic dependents, chained GEMMs copy their first weight stages early
    but read their activations only once the kernel before them has finished (the same bits as
    plain launches, eagerly and in a CUDA graph): after the split-K sum kernel (the default
    build splits these layers) and right after the GEMM before (unsplit)."""
    check_programmatic_chain(
        monkeypatch, lambda x, w, c, s: nvfp4_wgmma_cuda(x, w, c, s, None, config), 64)


def _run_with(monkeypatch: pytest.MonkeyPatch, build: Any, launch: Any) -> Any:
    """``linear_triton._run_wgmma`` on CPU tensors with the checks passed and the kernel's
    build (``wgmma_kernel``) and launch (``launch_wgmma``) replaced."""
    from kernelbay_quant_nvfp4 import cuda_wgmma, linear_triton
    from kernelbay_quant_nvfp4.triton_configs import KernelConfig

    monkeypatch.setattr(cuda_wgmma, "_BROKEN", {})
    monkeypatch.setattr(linear_triton, "cuda_wgmma_reason", lambda *a: None)
    monkeypatch.setattr(linear_triton, "sm_count", lambda index: 132)
    monkeypatch.setattr(linear_triton, "device_index", lambda x2: 0)
    monkeypatch.setattr(cuda_wgmma, "wgmma_kernel", build)
    monkeypatch.setattr(cuda_wgmma, "launch_wgmma", launch)
    tensors = nvfp4_weights(32, 256, torch.Generator().manual_seed(5))
    words, codes = _stored(tensors)
    return linear_triton._run_wgmma(KernelConfig("cw-x", "cuda-wgmma", wgmma=WgmmaConfig()),
                                    torch.randn(40, 256).bfloat16(), words, codes,
                                    tensors["weight_scale_2"], None)


def _raises(message: str) -> Any:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise CudaJitError(message)
    return fail


def test_a_build_failure_falls_back_to_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """When the GEMM does not build or load, the call warns once, returns nothing for the
    caller to fall back on, and the device is marked with the reason."""
    from kernelbay_quant_nvfp4 import cuda_wgmma

    build = _raises("NVRTC could not compile nvfp4_wgmma for sm_90a: unknown option")
    with pytest.warns(RuntimeWarning, match="wgmma GEMM is off on cuda:0.*unknown option"):
        assert _run_with(monkeypatch, build, _raises("not reached")) is None
    assert "unknown option" in str(cuda_wgmma.broken_reason(0))


def test_a_launch_failure_is_an_error_not_a_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only building and loading turn the GEMM off: when the kernel is there but a launch
    fails, the error reaches the caller and the device stays usable."""
    from kernelbay_quant_nvfp4 import cuda_wgmma

    launch = _raises("CUDA driver cuLaunchKernel failed: invalid argument (1)")
    with pytest.raises(CudaJitError, match="cuLaunchKernel"):
        _run_with(monkeypatch, lambda config, device: None, launch)
    assert cuda_wgmma.broken_reason(0) is None
