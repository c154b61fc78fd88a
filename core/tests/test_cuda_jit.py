"""``kernelbay.cuda_jit`` without a GPU: NVRTC compiles, the disk cache, compile errors with
the compiler's log, a cache folder that cannot be written. (Loading and launching need a
GPU: the plugins' GPU tests run their kernels through it.)"""

from __future__ import annotations

from typing import Any

import pytest
from kernelbay.cuda_jit import CudaJitError, compile_cubin, nvrtc_available


@pytest.mark.skipif(not nvrtc_available(), reason="needs NVRTC (nvidia-cuda-nvrtc)")
def test_cubins_are_cached_and_compile_errors_carry_the_log(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second compile of the same source and options reads the cache (the file is there
    and its bytes come back); a source that does not compile raises ``CudaJitError`` with
    NVRTC's log, naming the program and the options, and leaves no file behind."""
    import os

    monkeypatch.setenv("KERNELBAY_CACHE_DIR", str(tmp_path))
    src = 'extern "C" __global__ void k(float* p) { p[threadIdx.x] = 1.f; }'
    first = compile_cubin(src, "probe", "sm_90")
    cached = os.listdir(tmp_path / "cuda")
    assert len(cached) == 1 and cached[0].startswith("probe-sm_90-")
    (tmp_path / "cuda" / cached[0]).write_bytes(b"\x7fELF-marker")
    assert compile_cubin(src, "probe", "sm_90") == b"\x7fELF-marker"
    assert first[:4] == b"\x7fELF"
    with pytest.raises(CudaJitError, match=r"could not compile broken for sm_90(.|\n)*undefined"):
        compile_cubin('extern "C" __global__ void k() { undefined_name(); }', "broken", "sm_90")
    assert len(os.listdir(tmp_path / "cuda")) == 1


@pytest.mark.skipif(not nvrtc_available(), reason="needs NVRTC (nvidia-cuda-nvrtc)")
def test_an_unwritable_cache_warns_and_still_compiles(tmp_path: Any,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache folder that cannot be created costs a compile per process and a warning naming
    the folder, never the kernel."""
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("KERNELBAY_CACHE_DIR", str(blocker))
    src = 'extern "C" __global__ void k(float* p) { p[threadIdx.x] = 2.f; }'
    with pytest.warns(RuntimeWarning, match="could not cache probe's cubin in .*file"):
        cubin = compile_cubin(src, "probe", "sm_90")
    assert cubin[:4] == b"\x7fELF"


@pytest.mark.skipif(not nvrtc_available(), reason="needs NVRTC (nvidia-cuda-nvrtc)")
def test_sources_include_the_core_header_which_is_part_of_the_key(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``#include "kernelbay/ptx.cuh"`` resolves without a toolkit (the header comes from the
    package, in memory), and a changed header is a different cubin, not a stale cache hit."""
    import os

    from kernelbay import cuda_jit

    monkeypatch.setenv("KERNELBAY_CACHE_DIR", str(tmp_path))
    src = ('#include "kernelbay/ptx.cuh"\n'
           'extern "C" __global__ void k(u32* p) { p[threadIdx.x] = lds32(0u); commit(); }')
    assert compile_cubin(src, "probe", "sm_80")[:4] == b"\x7fELF"
    assert "cp.async.cg.shared.global" in cuda_jit.headers()["kernelbay/ptx.cuh"]
    changed = {name: text + "\n// changed\n" for name, text in cuda_jit.headers().items()}
    monkeypatch.setattr(cuda_jit, "headers", lambda: changed)
    compile_cubin(src, "probe", "sm_80")
    assert len(os.listdir(tmp_path / "cuda")) == 2
    with pytest.raises(CudaJitError, match=r"missing\.cuh"):
        compile_cubin('#include "kernelbay/missing.cuh"\n', "probe", "sm_80")


def test_tensor_map_rejects_what_the_hardware_would() -> None:
    """``tensor_map_2d`` names the bad value before calling the driver: the element type and
    swizzle (with the valid sets), alignment, the row stride, the box size and swizzle fit."""
    from kernelbay.cuda_jit import tensor_map_2d

    def reason(**kwargs: Any) -> str:
        args: dict[str, Any] = {"address": 4096, "dtype": "bfloat16", "rows": 64, "cols": 256,
                                "row_stride_bytes": 512, "box_rows": 64, "box_cols": 64}
        args.update(kwargs)
        with pytest.raises(ValueError) as info:
            tensor_map_2d(**args)
        return str(info.value)

    assert "dtype 'bf16'; valid: [" in reason(dtype="bf16")
    assert "swizzle 96; valid: [0, 32, 64, 128]" in reason(swizzle=96)
    assert "0x1008 must be 16-byte aligned" in reason(address=4104)
    assert "row stride of 520 bytes" in reason(row_stride_bytes=520)
    assert "row stride of 256 bytes" in reason(row_stride_bytes=256)
    assert "box 64 x 512" in reason(box_cols=512)
    assert "fit the 128-byte swizzle" in reason(box_cols=128)
    assert "multiple of 16" in reason(box_cols=4)


def test_programmatic_launch_config_matches_the_driver_layout() -> None:
    """``cuLaunchKernelEx``'s CUlaunchConfig as cuda.h lays it out on 64-bit hosts (grid and
    block, shared bytes, the stream at byte 32, the attribute array at 40, its length at 48;
    56 bytes) with one CUlaunchAttribute of 72 bytes: the id 6 (programmatic stream
    serialization) in the first four, the 64-byte value union from byte 8 holding the int 1."""
    import ctypes

    from kernelbay.cuda_jit import programmatic_config

    config, attr = programmatic_config((3, 2, 1), (128, 1, 1), 4096, 0xABC0)
    raw = ctypes.string_at(ctypes.addressof(config), ctypes.sizeof(config))
    assert len(raw) == 56
    words = [int.from_bytes(raw[4 * i:4 * i + 4], "little") for i in range(7)]
    assert words == [3, 2, 1, 128, 1, 1, 4096]
    assert int.from_bytes(raw[32:40], "little") == 0xABC0
    assert int.from_bytes(raw[40:48], "little") == ctypes.addressof(attr)
    assert int.from_bytes(raw[48:52], "little") == 1
    entry = ctypes.string_at(ctypes.addressof(attr), ctypes.sizeof(attr))
    assert len(entry) == 72
    assert int.from_bytes(entry[:4], "little") == 6
    assert int.from_bytes(entry[8:12], "little") == 1 and entry[12:] == bytes(60)


def test_programmatic_launch_reads_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """On unless ``KERNELBAY_PDL=0``; any other value names itself and the valid set."""
    from kernelbay.cuda_jit import programmatic_launch

    monkeypatch.delenv("KERNELBAY_PDL", raising=False)
    assert programmatic_launch() is True
    monkeypatch.setenv("KERNELBAY_PDL", "1")
    assert programmatic_launch() is True
    monkeypatch.setenv("KERNELBAY_PDL", "0")
    assert programmatic_launch() is False
    assert programmatic_launch(0) is False  # no device is asked about when off
    monkeypatch.setenv("KERNELBAY_PDL", "yes")
    with pytest.raises(ValueError, match=r"KERNELBAY_PDL='yes'; valid: '1'.*'0'"):
        programmatic_launch()


@pytest.mark.skipif(not nvrtc_available(), reason="needs NVRTC (nvidia-cuda-nvrtc)")
def test_grid_dependency_control_only_from_sm_90(tmp_path: Any,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """``grid_dependency_wait`` / ``grid_dependents_launch`` compile to the sm_90 instructions
    there and to nothing for sm_80, so one source serves both."""
    from kernelbay.testing.cubins import cubin_sass

    monkeypatch.setenv("KERNELBAY_CACHE_DIR", str(tmp_path))
    src = ('#include "kernelbay/ptx.cuh"\n'
           'extern "C" __global__ void k(float* p) { grid_dependents_launch(); '
           'grid_dependency_wait(); p[threadIdx.x] = 1.f; }')
    sass = {arch: cubin_sass(compile_cubin(src, "probe", arch)) for arch in ("sm_80", "sm_90")}
    if None in sass.values():
        pytest.skip("cuobjdump not found (it comes with triton)")
    assert "ACQBULK" in str(sass["sm_90"]) and "PREEXIT" in str(sass["sm_90"])
    assert "ACQBULK" not in str(sass["sm_80"]) and "PREEXIT" not in str(sass["sm_80"])
