"""The bulk-copy NVFP4 GEMV (``cuda_gemv_bulk``, sm_90, built by NVRTC) against the reference
(``kernelbay.formats.dequantize_nvfp4`` + matmul in float32) with the bound of the other
kernels' tests (``nvfp4_triton_helpers.check_close``); on any machine, its builds compile and
its split of K follows the GPU's CTA slots."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from kernelbay.cuda_jit import compile_cubin, nvrtc_available
from kernelbay.formats import dequantize_nvfp4
from kernelbay_quant_nvfp4.cuda_gemv_bulk import (
    BulkGemvConfig,
    config_for,
    launch_bulk,
    shared_bytes,
    splits_for,
)
from kernelbay_quant_nvfp4.linear_triton import layout_tensors
from nvfp4_triton_helpers import (
    check_close,
    cuda_weights,
    edge_scales,
    every_code_and_scale,
    nvfp4_weights,
    strided_extreme_activations,
)

#: The defaults (M <= 8, M <= 16), uneven splits, and the multi-tile builds of the sweep.
BUILDS = [BulkGemvConfig(), BulkGemvConfig(splits=3), BulkGemvConfig(nt=2, stages=4, splits=2),
          BulkGemvConfig(4, 2, 2, 1, 4, 4), BulkGemvConfig(2, 2, 4, 2, 4, 2),
          BulkGemvConfig(8, 1, 1, 2, 4, 8)]


def _gpu_sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def test_rule_picks_small_layers_and_splits_within_one_wave() -> None:
    """The bulk build serves layers of at most one CTA per SM (one 16-row tile each, two
    above 8 tokens once the tiles outnumber half the SMs; else ``None``); K is split as far as one CTA per SM and three stages per CTA allow; every
    build the rule makes fits an sm_90 SM's shared memory."""
    assert config_for(1, 1024, 8192, 132) == BulkGemvConfig(splits=2)
    assert config_for(1, 2048, 8192, 132) == BulkGemvConfig(splits=1)
    assert config_for(16, 1024, 4096, 132) == BulkGemvConfig(nt=2, stages=4, splits=1)
    assert config_for(16, 512, 8192, 132) == BulkGemvConfig(nt=2, stages=4, splits=2)
    # above 8 tokens, two tiles per CTA once the layer has more tiles than half the SMs
    assert config_for(16, 2048, 8192, 132) == BulkGemvConfig(tm=2, nt=2, stages=4, splits=2)
    assert config_for(1, 4096, 8192, 132) is None
    assert config_for(16, 3584, 8192, 132) == BulkGemvConfig(tm=2, nt=2, stages=4, splits=1)
    assert config_for(16, 4608, 8192, 132) is None
    assert config_for(17, 1024, 8192, 132) is None
    for m in (1, 8, 9, 16):
        for n in (16, 1024, 2112):
            build = config_for(m, n, 8192, 132)
            assert build is not None and 8 * build.nt >= m
            assert shared_bytes(build) <= 227 * 1024
            assert -(-n // build.rows) * build.splits <= 132
    assert splits_for(BulkGemvConfig(), 16, 8192 * 8, 132) == 8


@pytest.mark.skipif(not nvrtc_available(), reason="needs NVRTC (nvidia-cuda-nvrtc)")
def test_builds_compile_without_local_memory(tmp_path: Any,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Every build of the tests compiles for sm_90 with everything in registers."""
    from kernelbay.testing.cubins import cubin_resources
    from kernelbay_quant_nvfp4.cuda_gemv_bulk import _source, build_options

    monkeypatch.setenv("KERNELBAY_CACHE_DIR", str(tmp_path))
    for build in BUILDS:
        build = build if build.splits else build.with_splits(2)
        cubin = compile_cubin(_source(), "nvfp4_gemv_bulk", "sm_90", build_options(build))
        usage = cubin_resources(cubin)
        assert usage is None or ("STACK:0 " in usage and "LOCAL:0 " in usage), (build.name,
                                                                                usage)


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("config", BUILDS, ids=lambda c: c.name)
@pytest.mark.parametrize(("n", "k"), [(16, 1024), (48, 3200), (1008, 3200), (304, 8192)])
def test_bulk_gemv_matches_reference(config: BulkGemvConfig, n: int, k: int) -> None:
    """Row blocks that the last CTA does not fill, K splits of uneven chunk counts (a short
    last stage included), every M from 1 to 16 that changes the token tiles, bias or none,
    edge block scales."""
    if k // 128 < max(config.splits, 1) * config.wk:
        pytest.skip("fewer chunks than the split needs")
    gen = torch.Generator().manual_seed(n * 7 + k)
    tensors = {name: t.cuda() for name, t in nvfp4_weights(n, k, gen).items()}
    edge_scales(tensors)
    w = dequantize_nvfp4(tensors["weight"], tensors["weight_scale"], tensors["weight_scale_2"])
    words, codes = layout_tensors(tensors["weight"], tensors["weight_scale"], "tiles")
    for m in (1, 2, 7, 8, 9, 16):
        if m > 8 * config.nt:
            continue
        bias = torch.randn(n, generator=gen).bfloat16().cuda() if m % 2 else None
        x = torch.randn(m, k, generator=gen).bfloat16().cuda()
        got = launch_bulk(x, words, codes, tensors["weight_scale_2"], bias, config)
        check_close(got, x, w, bias)
        again = launch_bulk(x, words, codes, tensors["weight_scale_2"], bias, config)
        assert torch.equal(got, again)   # a fixed order of sums: the same bits every run


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_sm90(), reason="needs an sm_90 GPU")
def test_bulk_gemv_strided_activations_extremes_and_every_code() -> None:
    """Strided activation rows at bf16's extremes stay within the bound; every E2M1 code under
    every finite E4M3 block scale times identity activations is the reference, bit for bit."""
    gen = torch.Generator().manual_seed(11)
    tensors, w = cuda_weights(208, 1024, gen)
    words, codes = layout_tensors(tensors["weight"], tensors["weight_scale"], "tiles")
    x = strided_extreme_activations(5, 1024, gen)
    got = launch_bulk(x, words, codes, tensors["weight_scale_2"], None,
                      BulkGemvConfig(splits=2))
    check_close(got, x, w, None)

    tensors, eye = every_code_and_scale()
    tensors = {name: t.cuda() for name, t in tensors.items()}
    w = dequantize_nvfp4(tensors["weight"], tensors["weight_scale"], tensors["weight_scale_2"])
    words, codes = layout_tensors(tensors["weight"], tensors["weight_scale"], "tiles")
    eye = eye.cuda()
    config = BulkGemvConfig(nt=2, stages=4, splits=2)
    got = torch.cat([launch_bulk(eye[i:i + 16], words, codes, tensors["weight_scale_2"], None,
                                 config) for i in range(0, eye.shape[0], 16)])
    assert torch.equal(got, w.T.to(torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_sm90(), reason="needs an sm_90 GPU")
def test_default_runs_bulk_on_small_layers_and_falls_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``ct-default`` on a small layer launches the rule's bulk build; when that build fails
    to compile or load, one warning says so, the per-lane GEMV serves the call (same bound)
    and the device is marked so that later calls skip the bulk build."""
    from kernelbay.cuda_jit import CudaJitError
    from kernelbay_quant_nvfp4 import cuda_gemv_bulk, linear_triton
    from kernelbay_quant_nvfp4.triton_configs import DEFAULT_CONFIGS

    gen = torch.Generator().manual_seed(21)
    tensors, w = cuda_weights(1024, 2048, gen)
    words, codes = layout_tensors(tensors["weight"], tensors["weight_scale"], "tiles")
    x = torch.randn(4, 2048, generator=gen).bfloat16().cuda()
    builds: list[BulkGemvConfig] = []
    launch = cuda_gemv_bulk.launch_bulk

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        builds.append(args[5])
        return launch(*args, **kwargs)

    monkeypatch.setattr(cuda_gemv_bulk, "launch_bulk", spy)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    got = linear_triton.run_config(DEFAULT_CONFIGS[0][1], x, words, codes,
                                   tensors["weight_scale_2"], None)
    check_close(got, x, w, None)
    assert builds == [config_for(4, 1024, 2048, sms)]

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise CudaJitError("NVRTC could not compile nvfp4_gemv_bulk for sm_99: unknown arch")

    monkeypatch.setattr(cuda_gemv_bulk, "_BROKEN", {})
    monkeypatch.setattr(cuda_gemv_bulk, "bulk_kernel", failing)
    with pytest.warns(RuntimeWarning, match="bulk-copy GEMV is off.*per-lane GEMV"):
        got = linear_triton.run_config(DEFAULT_CONFIGS[0][1], x, words, codes,
                                       tensors["weight_scale_2"], None)
    check_close(got, x, w, None)
    assert "unknown arch" in str(cuda_gemv_bulk.broken_reason(x.device.index or 0))
    assert len(builds) == 1
