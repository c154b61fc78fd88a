"""The CUDA GEMV of ``nvfp4-triton`` at M <= 16 (``cuda_gemv``, built by NVRTC) against the
reference (``kernelbay.formats.dequantize_nvfp4`` + matmul in float32), with the bound of
``test_nvfp4_triton`` (``nvfp4_triton_helpers.check_close``); and, on any machine, what it
refuses and why."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from kernelbay.cuda_jit import CudaJitError, compile_cubin, nvrtc_available
from kernelbay.formats import dequantize_nvfp4
from kernelbay_quant_nvfp4.cuda_gemv import (
    GemvConfig,
    config_for_m,
    gemv_unsupported,
    nvfp4_gemv_cuda,
    shared_bytes,
)
from kernelbay_quant_nvfp4.linear_triton import layout_tensors
from nvfp4_triton_helpers import (
    check_close,
    check_programmatic_chain,
    cuda_weights,
    edge_scales,
    every_code_and_scale,
    nvfp4_weights,
    strided_extreme_activations,
)


def _stored(tensors: dict[str, torch.Tensor], tiled: bool = True
            ) -> tuple[torch.Tensor, torch.Tensor]:
    layout = "tiles" if tiled else "fragment"
    return layout_tensors(tensors["weight"], tensors["weight_scale"], layout)


def test_refusals_name_the_operand() -> None:
    """On CPU tensors, with fp16, M > 16, K not whole chunks or the wrong layout, the reason
    says what is expected."""
    gen = torch.Generator().manual_seed(0)
    tensors = nvfp4_weights(32, 256, gen)
    words, codes = _stored(tensors)
    x = torch.randn(4, 256, generator=gen).bfloat16()
    assert "CUDA device" in str(gemv_unsupported(x, words, codes))
    with pytest.raises(ValueError, match="CUDA device"):
        nvfp4_gemv_cuda(x, words, codes, tensors["weight_scale_2"], None)
    if not torch.cuda.is_available():
        return
    words, codes, xc = words.cuda(), codes.cuda(), x.cuda()
    assert gemv_unsupported(xc, words, codes) is None
    assert "bfloat16" in str(gemv_unsupported(xc.half(), words, codes))
    assert "M <= 16" in str(gemv_unsupported(torch.zeros(17, 256, dtype=torch.bfloat16,
                                                         device="cuda"), words, codes))
    assert "int32 [N/16, 2, 256]" in str(gemv_unsupported(xc, words.reshape(4, -1), codes))
    frag_w, frag_c = (t.cuda() for t in _stored(tensors, tiled=False))
    assert gemv_unsupported(xc, frag_w, frag_c, tiled=False) is None
    assert "int32 [N, 8, 4]" in str(gemv_unsupported(xc, words, codes, tiled=False))
    assert "aligned" in str(gemv_unsupported(
        torch.zeros(4, 264, dtype=torch.bfloat16, device="cuda")[:, 1:257], words, codes))


def test_shared_memory_and_defaults() -> None:
    """The pipeline's slots (16 + 4 bytes per lane, row, tile, warp and stage) or the partial
    sums, whichever is larger; the defaults fit two CTAs in an sm_90 SM (227 KB)."""
    assert shared_bytes(GemvConfig(2, 1, 8, 4, 2)) == 8 * 4 * 2 * 2 * 640
    assert shared_bytes(GemvConfig(1, 2, 1, 2, 1)) == max(1 * 2 * 1 * 2 * 640, 16 * 16 * 4)
    assert shared_bytes(GemvConfig(1, 1, 2, 4, 1, wn=4)) == 8 * 4 * 1 * 2 * 640
    for m in (1, 8, 9, 16):
        for n in (4096, 8192, 28672):
            config = config_for_m(m, n, 8192, 132)
            assert 8 * config.nt >= m
            assert config.min_blocks * shared_bytes(config) <= 227 * 1024
    # eight warps over a long K while the CTAs fit in one wave of two per SM, else four
    assert config_for_m(1, 8192, 28672, 132).wk == 8
    assert config_for_m(1, 8192, 8192, 132).wk == 4
    assert config_for_m(1, 28672, 28672, 132).wk == 4
    # two to eight tokens on rows that fill a wave in 128-row blocks: four warps over rows
    for m in (2, 8):
        assert config_for_m(m, 28672, 8192, 132) == GemvConfig(2, 1, 2, 4, 2, wn=4)
    assert config_for_m(1, 28672, 8192, 132) == GemvConfig(2, 1, 4, 4, 4)
    assert config_for_m(4, 8192, 8192, 132) == GemvConfig(2, 1, 4, 4, 4)
    assert config_for_m(16, 28672, 8192, 132).wn == 1


def test_programmatic_builds_fill_one_wave() -> None:
    """Under programmatic launches: the early-release build whose CTAs fill most of one wave
    of their slots (at least 80%); where none does, the plain rule's build."""
    def pick(m: int, n: int, k: int = 8192) -> GemvConfig:
        return config_for_m(m, n, k, 132, programmatic=True)

    eight = GemvConfig(2, 1, 8, 4, 2, early_release=True)
    assert pick(1, 8192) == eight  # 256 CTAs of 264 slots
    assert pick(4, 8192, 28672) == eight
    assert pick(1, 28672) == GemvConfig(2, 1, 2, 4, 2, wn=4, early_release=True)  # 224 / 264
    assert pick(16, 8192) == replace(eight, nt=2)
    # 4096 rows: 128 CTAs of 264 slots at best, so no early release
    assert pick(1, 4096) == config_for_m(1, 4096, 8192, 132)
    assert not pick(1, 4096).early_release
    for m in (1, 4, 16):
        for n in (4096, 8192, 28672):
            assert 8 * pick(m, n).nt >= m


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, GemvConfig(1, 1, 8, 6, 2), GemvConfig(2, 2, 4, 4, 2),
                                    GemvConfig(4, 1, 8, 4, 1), GemvConfig(1, 2, 16, 2, 1),
                                    GemvConfig(1, 2, 2, 4, 2, wn=4),
                                    GemvConfig(2, 1, 2, 4, 2, wn=4),
                                    GemvConfig(2, 2, 4, 4, 2, tiled=False)],
                         ids=lambda c: "default" if c is None else c.name)
@pytest.mark.parametrize(("n", "k"), [(16, 128), (48, 384), (1008, 3200), (304, 8192)])
def test_cuda_gemv_matches_reference(config: GemvConfig | None, n: int, k: int) -> None:
    """Row tiles that do not fill the last CTA, K of 1 to 64 chunks (fewer chunks than warps
    included), every M from 1 to 16 that changes the token tiles, bias or none, edge block
    scales; the fragment-layout build also with N not a multiple of 16."""
    if config is not None and not config.tiled:
        n -= 8
    gen = torch.Generator().manual_seed(n * 7 + k)
    tensors = {name: t.cuda() for name, t in nvfp4_weights(n, k, gen).items()}
    if n > 1:
        edge_scales(tensors)
    w = dequantize_nvfp4(tensors["weight"], tensors["weight_scale"], tensors["weight_scale_2"])
    words, codes = _stored(tensors, config is None or config.tiled)
    for m in (1, 2, 7, 8, 9, 16):
        if config is not None and m > 8 * config.nt:
            continue
        bias = torch.randn(n, generator=gen).bfloat16().cuda() if m % 2 else None
        x = torch.randn(m, k, generator=gen).bfloat16().cuda()
        got = nvfp4_gemv_cuda(x, words, codes, tensors["weight_scale_2"], bias, config)
        check_close(got, x, w, bias)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available()
                    or torch.cuda.get_device_capability() < (9, 0),
                    reason="programmatic launches need compute capability 9.0+")
@pytest.mark.parametrize("config", [None, GemvConfig(2, 1, 4, 4, 4, early_release=True)],
                         ids=["default", "early-release"])
def test_cuda_gemv_programmatic_launches_wait(config: GemvConfig | None,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Launched as programmatic dependents, chained GEMVs copy their first weight stages early
    but read their activations only once the kernel before them has finished (the same bits as
    plain launches, eagerly and in a CUDA graph), whether they release the next launch after
    their K loop or at their start."""
    check_programmatic_chain(
        monkeypatch, lambda x, w, c, s: nvfp4_gemv_cuda(x, w, c, s, None, config), 4)


@pytest.mark.gpu
def test_cuda_gemv_strided_activations_and_extremes() -> None:
    """Activation rows with a stride (a slice of a wider tensor), and activations at bf16's
    extremes (huge values, subnormals, zeros): the sums stay within the bound."""
    gen = torch.Generator().manual_seed(11)
    k = 1024
    tensors, w = cuda_weights(208, k, gen)
    words, codes = _stored(tensors)
    x = strided_extreme_activations(5, k, gen)
    got = nvfp4_gemv_cuda(x, words, codes, tensors["weight_scale_2"], None)
    check_close(got, x, w, None)


@pytest.mark.gpu
def test_cuda_gemv_every_code_and_scale_exact() -> None:
    """Every E2M1 code under every finite E4M3 block scale, one exact product per output (the
    identity activations, 16 rows at a time): the reference rounded to bf16, bit for bit."""
    tensors, eye = every_code_and_scale()
    tensors = {name: t.cuda() for name, t in tensors.items()}
    w = dequantize_nvfp4(tensors["weight"], tensors["weight_scale"], tensors["weight_scale_2"])
    words, codes = _stored(tensors)
    eye = eye.cuda()
    got = torch.cat([nvfp4_gemv_cuda(eye[i:i + 16], words, codes, tensors["weight_scale_2"],
                                     None) for i in range(0, eye.shape[0], 16)])
    assert torch.equal(got, w.T.to(torch.bfloat16))


@pytest.mark.skipif(not nvrtc_available(), reason="needs NVRTC (nvidia-cuda-nvrtc)")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_build_compiles_and_defaults_do_not_spill(arch: str, tmp_path: Any,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA source compiles (NVRTC, no GPU needed) for every build the sweep and the
    defaults use, on both layouts; the default builds keep everything in registers (no local
    memory in ``cuobjdump``'s resource usage, when triton's copy of it is installed)."""
    from kernelbay.testing.cubins import cubin_resources
    from kernelbay_quant_nvfp4.cuda_gemv import _source, build_options
    from kernelbay_quant_nvfp4.triton_configs import CANDIDATES

    monkeypatch.setenv("KERNELBAY_CACHE_DIR", str(tmp_path))
    builds = {config_for_m(m, n, k, 132) for m in (1, 4, 16) for n in (8192, 28672)
              for k in (8192, 28672)}
    sweep = {replace(c.gemv, nt=nt) for c in CANDIDATES if c.gemv is not None for nt in (1, 2)}
    for build in sorted(builds | sweep, key=lambda b: b.name):
        cubin = compile_cubin(_source(), "nvfp4_gemv", arch, build_options(build))
        assert cubin[:4] == b"\x7fELF", build.name
        usage = cubin_resources(cubin) if build in builds else None
        assert usage is None or ("STACK:0 " in usage and "LOCAL:0 " in usage), (build.name,
                                                                                usage)


@pytest.mark.skipif(not nvrtc_available(), reason="needs NVRTC (nvidia-cuda-nvrtc)")
def test_programmatic_release_point(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """On sm_90 the GEMV waits for the kernel before it (ACQBULK) after its first weight
    copies and before any activation load; it releases the next programmatic launch (PREEXIT)
    after its K loop, or before the wait in the ``early_release`` builds."""
    import re

    from kernelbay.testing.cubins import cubin_sass
    from kernelbay_quant_nvfp4.cuda_gemv import _source, build_options

    monkeypatch.setenv("KERNELBAY_CACHE_DIR", str(tmp_path))
    for early in (False, True):
        build = GemvConfig(2, 1, 4, 4, 4, early_release=early)
        sass = cubin_sass(compile_cubin(_source(), "nvfp4_gemv", "sm_90", build_options(build)))
        if sass is None:
            pytest.skip("cuobjdump not found (it comes with triton)")
        order = [op for op in re.findall(r"\b(LDGSTS|ACQBULK|PREEXIT|LDG|HMMA)\b", sass)]
        wait, release = order.index("ACQBULK"), order.index("PREEXIT")
        assert order.count("ACQBULK") == 1 and order.count("PREEXIT") == 1
        assert "LDGSTS" in order[:wait] and "LDG" not in order[:wait]
        assert (release < wait) == early
        if not early:
            assert "HMMA" in order[wait:release]


def test_a_build_failure_falls_back_to_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """When the GEMV does not build or load (an architecture NVRTC does not know, a driver
    older than the cubin), the call warns once, returns nothing for the caller to fall back
    on, and the device is marked so that later calls skip the GEMV with that reason."""
    from kernelbay_quant_nvfp4 import cuda_gemv, linear_triton
    from kernelbay_quant_nvfp4.triton_configs import DEFAULT_CONFIGS

    def failing(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise CudaJitError("NVRTC could not compile nvfp4_gemv for sm_99: unknown arch")

    monkeypatch.setattr(cuda_gemv, "_BROKEN", {})
    monkeypatch.setattr(linear_triton, "cuda_gemv_reason", lambda *a: None)
    monkeypatch.setattr(linear_triton, "device_index", lambda x2: 0)
    monkeypatch.setattr(cuda_gemv, "gemv_kernel", failing)
    tensors = nvfp4_weights(32, 256, torch.Generator().manual_seed(5))
    words, codes = _stored(tensors)
    x = torch.randn(2, 256).bfloat16()
    with pytest.warns(RuntimeWarning, match="CUDA GEMV is off on cuda:0.*sm_99"):
        got = linear_triton._run_cuda(DEFAULT_CONFIGS[0][1], x, words, codes,
                                      tensors["weight_scale_2"], None)
    assert got is None
    assert "unknown arch" in str(cuda_gemv.broken_reason(0))
