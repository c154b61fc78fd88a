"""The M tables' weight layouts: one per table, stored once after loading, checked by
``run_config``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from kernelbay.formats import checkpoint_layout, dequantize_nvfp4
from kernelbay_quant_nvfp4.linear_triton import (
    checkpoint_tensors,
    layout_tensors,
    run_config,
    stored_tensors,
)
from kernelbay_quant_nvfp4.triton_configs import (
    DEFAULT_CONFIGS,
    FRAGMENT_CONFIGS,
    K_ORDER_CONFIGS,
    KernelConfig,
    table_for,
    table_layout,
)


def test_tables_read_one_layout() -> None:
    assert table_layout(DEFAULT_CONFIGS) == "tiles"
    assert table_layout(FRAGMENT_CONFIGS) == "fragment"
    assert table_layout(K_ORDER_CONFIGS) == "repacked"
    mixed = ((16, KernelConfig("a", "repacked")), (1 << 62, KernelConfig("b", "dequant")))
    with pytest.raises(ValueError, match=r"mixes them: a \(repacked\), b \(checkpoint\)"):
        table_layout(mixed)


def test_tables_follow_what_the_layout_can_hold() -> None:
    """The tiles layout holds whole 16-row tiles and 128-element chunks, the fragment order
    32-element groups: other layers store and run the fragment or the repacked K-order
    table; the method picks it from its request."""
    from kernelbay.requests import LinearRequest
    from kernelbay_quant_nvfp4.linear_triton import Nvfp4TritonLinear
    from kernelbay_quant_nvfp4.schemes import nvfp4_scheme

    assert table_for(64, 4096) is DEFAULT_CONFIGS
    assert table_for(72, 4096) is FRAGMENT_CONFIGS and table_for(64, 4160) is FRAGMENT_CONFIGS
    assert table_for(64, 4112) is K_ORDER_CONFIGS
    assert table_for(8, 4096, FRAGMENT_CONFIGS) is FRAGMENT_CONFIGS
    mine = ((1 << 62, KernelConfig("d", "dequant")),)
    assert table_for(7, 4112, mine) is mine  # a checkpoint-layout table serves any shape
    scheme = nvfp4_scheme("modelopt", w4a4=False)
    assert Nvfp4TritonLinear(LinearRequest(48, 8, scheme, "bfloat16")).table() is K_ORDER_CONFIGS
    assert Nvfp4TritonLinear(LinearRequest(64, 8, scheme, "bfloat16")).table() is FRAGMENT_CONFIGS
    assert Nvfp4TritonLinear(LinearRequest(128, 16, scheme, "bfloat16")).table() \
        is DEFAULT_CONFIGS


def test_stored_tensors_round_trip_stacked_experts() -> None:
    packed = torch.randint(0, 256, (3, 4, 16), dtype=torch.uint8)
    scales = torch.rand(3, 4, 2).to(torch.float8_e4m3fn)
    stored, kept = stored_tensors(packed, scales, ((1, KernelConfig("pr", "repacked")),))
    assert stored.shape == (3, 4, 4) and stored.dtype == torch.int32 and kept is not None
    assert torch.equal(checkpoint_layout(stored[1]), packed[1])
    checkpoint = ((1 << 62, KernelConfig("d", "dequant")),)
    assert stored_tensors(packed, scales, checkpoint)[0].dtype == torch.uint8


def test_fragment_layout_dequantizes_to_the_same_values() -> None:
    """The fragment layout folds signs and zeros of the block scales into the codes and
    stores scale codes: converted back (``checkpoint_tensors``) it dequantizes through the
    reference to the checkpoint's values, bit for bit, stacked experts too."""
    gen = torch.Generator().manual_seed(3)
    packed = torch.randint(0, 256, (2, 5, 32), generator=gen, dtype=torch.uint8)
    bits = torch.randint(0, 256, (2, 5, 4), generator=gen, dtype=torch.uint8)
    bits[(bits & 0x7F) == 0x7F] = 0x80  # finite scales only; -0 included
    bits[0, 0, 0], bits[1, 4, 3] = 0x00, 0x01
    scales = bits.view(torch.float8_e4m3fn)
    words, codes = layout_tensors(packed, scales, "fragment")
    assert words.shape == (2, 5, 2, 4) and codes.dtype == torch.uint8
    glob = torch.tensor(0.75)
    for e in range(2):
        back = checkpoint_tensors(words[e], codes[e])
        want = dequantize_nvfp4(packed[e], scales[e], glob)
        assert torch.equal(dequantize_nvfp4(*back, glob).view(torch.int32),
                           want.view(torch.int32))


def test_unknown_layout_is_named() -> None:
    packed = torch.zeros(2, 16, dtype=torch.uint8)
    scales = torch.ones(2, 2, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"weight layout 'mma'; valid: \('checkpoint', "
                                         r"'repacked', 'fragment', 'tiles'\)"):
        layout_tensors(packed, scales, "mma")


def test_run_config_names_a_layout_mismatch() -> None:
    x = torch.zeros(1, 32, dtype=torch.bfloat16)
    packed = torch.zeros(4, 16, dtype=torch.uint8)
    scales = torch.ones(4, 2, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="config pr reads the repacked weight layout"):
        run_config(KernelConfig("pr", "repacked"), x, packed, scales, torch.ones(1), None)
    words = torch.zeros(4, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"config pf reads the fragment weight layout.*"
                                         r"\(repacked\)"):
        run_config(KernelConfig("pf", "fragment"), x, words, scales, torch.ones(1), None)


@pytest.mark.parametrize(("m", "n", "k", "want"), [(1, 8192, 8192, 4), (16, 28672, 8192, 2),
                                                   (16, 8192, 28672, 4), (64, 8192, 8192, 4),
                                                   (64, 28672, 8192, 1), (64, 8192, 28672, 4),
                                                   (256, 8192, 8192, 1), (1, 64, 512, 1)])
def test_split_rule_on_the_benchmark_shapes(m: int, n: int, k: int, want: int) -> None:
    """The split counts the H200 sweeps found best for the default Triton kernels (132 SMs),
    and no split when K has too few tiles."""
    from kernelbay_quant_nvfp4.triton_configs import WGMMA_FALLBACK, config_for, split_k_for

    assert split_k_for(config_for(m, WGMMA_FALLBACK), m, n, k, 132) == want


def test_tiles_layout_round_trips_and_rejects_partial_tiles() -> None:
    """The tiles layout regroups the fragment words and codes exactly (stacked experts
    included) and dequantizes to the checkpoint's values; N not a multiple of 16 or K not of
    128 is refused with both shapes named."""
    from kernelbay.formats import dequantize_nvfp4, quantize_nvfp4
    from kernelbay_quant_nvfp4.linear_triton import fragment_of_tiles, tiles_of_fragment

    w = torch.randn(2, 48, 384, generator=torch.Generator().manual_seed(3))
    packed, scales, g = quantize_nvfp4(w.reshape(96, 384))
    packed, scales = packed.reshape(2, 48, 192), scales.reshape(2, 48, 24)
    frag = layout_tensors(packed, scales, "fragment")
    tiles = layout_tensors(packed, scales, "tiles")
    assert tiles[0].shape == (2, 3, 3, 256) and tiles[1].shape == (2, 3, 3, 128)
    back = fragment_of_tiles(*tiles)
    assert torch.equal(back[0], frag[0]) and torch.equal(back[1], frag[1])
    # word (row 8 h + g, group 4 j + c) sits at [tile, j, 128 h + 16 g + 4 c]
    assert torch.equal(tiles[0][1, 2, 1, 128 + 16 * 3 + 4 * 2:][:4], frag[0][1, 2 * 16 + 8 + 3, 4 * 1 + 2])
    p, s = checkpoint_tensors(tiles[0][0], tiles[1][0])
    assert torch.equal(dequantize_nvfp4(p, s, g), dequantize_nvfp4(packed[0], scales[0], g))
    with pytest.raises(ValueError, match=r"N a multiple of 16 and K of 128.*\(40, 12, 4\)"):
        tiles_of_fragment(*layout_tensors(packed[0, :40], scales[0, :40], "fragment"))


def test_explain_note_names_the_kernel_per_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """``nvfp4-triton``'s accept note lists the kernels by batch size for the layer's table,
    with the CUDA GEMV and the wgmma GEMM only where they can be built and the reason they
    cannot otherwise."""
    from kernelbay import cuda_jit
    from kernelbay.device import parse_device
    from kernelbay.requests import LinearRequest
    from kernelbay_quant_nvfp4.linear_triton import Nvfp4TritonLinear
    from kernelbay_quant_nvfp4.schemes import nvfp4_scheme

    scheme = nvfp4_scheme("modelopt", w4a4=False)
    hopper = parse_device("sm_90")

    def note(n: int, k: int, dtype: str = "bfloat16", device: str = "sm_90") -> str:
        verdict = Nvfp4TritonLinear.can_implement(LinearRequest(k, n, scheme, dtype),
                                                  parse_device(device) if device else hopper)
        assert verdict.accepted
        return verdict.notes[0]

    monkeypatch.setattr(cuda_jit, "find_nvrtc", lambda: "/lib/libnvrtc.so")
    assert note(4096, 4096) == ("kernels by batch (tiles layout): M <= 8: CUDA GEMV "
                                "(ct-default, NVRTC; the bulk-copy build on GPUs of at least "
                                "256 SMs), M <= 16: bulk-copy CUDA GEMV (cb-default, NVRTC) "
                                "where its CTAs fit one per SM, else pt-16x64x256-p3, M <= 32: "
                                "pt-64x128x128-w8, larger M: CUDA wgmma GEMM (cw-default, "
                                "NVRTC, sm_90a) where its grid fills the GPU, else "
                                "pt-64x128x128-w8 up to M = 64 / pt-128x128x128-w8")
    assert "M <= 8: pt-16x64x256-p3 (the CUDA GEMV: float16 activations)" in \
        note(4096, 4096, "float16")
    assert ("larger M: pt-64x128x128-w8 up to M = 64 / pt-128x128x128-w8 (the CUDA wgmma GEMM: "
            "float16 activations)") in note(4096, 4096, "float16")
    assert "(the CUDA GEMV: not on rocm gfx942)" in note(4096, 4096, device="gfx942")
    assert "(the CUDA wgmma GEMM: needs compute capability 9.0, not cuda sm_80)" in \
        note(4096, 4096, device="sm_80")
    assert note(4104, 4096).startswith("kernels by batch (fragment layout): M <= 16: pf-")
    assert ("M <= 8: CUDA GEMV (ct-default, NVRTC), M <= 16: pt-16x64x256-p3 (the bulk-copy "
            "CUDA GEMV: needs compute capability >= 9.0, not cuda sm_80)") in \
        note(1024, 4096, device="sm_80")
    monkeypatch.setattr(cuda_jit, "find_nvrtc", lambda: None)
    assert "(the CUDA GEMV: no NVRTC on this machine)" in note(4096, 4096)
    assert "(the CUDA wgmma GEMM: no NVRTC on this machine)" in note(4096, 4096)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/self/maps")
def test_planning_does_not_load_nvrtc() -> None:
    """Asking ``nvfp4-triton`` about a layer looks NVRTC up on disk and never loads it (nor
    the driver): planning stays light whatever the machine has."""
    code = """
import sys
from kernelbay.device import parse_device
from kernelbay.requests import LinearRequest
from kernelbay_quant_nvfp4.linear_triton import Nvfp4TritonLinear
from kernelbay_quant_nvfp4.schemes import nvfp4_scheme
v = Nvfp4TritonLinear.can_implement(
    LinearRequest(4096, 4096, nvfp4_scheme("modelopt", w4a4=False), "bfloat16"),
    parse_device("sm_90"))
assert v.accepted, v
maps = open("/proc/self/maps").read()
sys.exit(1 if ("libnvrtc" in maps or "libcuda" in maps) else 0)
"""
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
