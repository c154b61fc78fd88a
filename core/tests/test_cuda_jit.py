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


def test_programmatic_edge_matches_the_driver_layout() -> None:
    """CUgraphEdgeData as cuda.h lays it out: eight bytes, the upstream port first (1:
    CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC), the downstream port (0), the dependency type (1:
    CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC), five reserved zero bytes."""
    import ctypes

    from kernelbay.cuda_jit import programmatic_edge

    edge = programmatic_edge()
    assert ctypes.string_at(ctypes.addressof(edge), ctypes.sizeof(edge)) == bytes(
        [1, 0, 1, 0, 0, 0, 0, 0])


def test_programmatic_dependent_links_only_launches_made_through_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A simulated capture: the first launch follows a node not made here (a torch kernel) and
    stays plain; the next one follows that launch and gets one programmatic edge from exactly
    that node; after a join (two predecessors) or in another capture, plain again; outside a
    capture nothing is asked of the driver."""
    import ctypes

    from kernelbay import cuda_jit

    tails: list[tuple[int, list[int]] | None] = []
    edges: list[tuple[int, bytes, int, int]] = []

    class FakeDriver:
        def cuStreamUpdateCaptureDependencies_v2(self, stream, nodes, edge, count, flags):
            data = ctypes.cast(edge, ctypes.POINTER(ctypes.c_ubyte * 8)).contents
            edges.append((nodes[0], bytes(data), count, flags))
            return 0

    monkeypatch.setattr(cuda_jit, "_cuda", lambda: FakeDriver())
    monkeypatch.setattr(cuda_jit, "_capture_tail", lambda stream: tails.pop(0))
    monkeypatch.setattr(cuda_jit, "_releasing", {})

    def launch(before: tuple[int, list[int]] | None,
               after: tuple[int, list[int]] | None) -> bool:
        tails[:] = [before, after]
        with cuda_jit.programmatic_dependent(0xABC) as made:
            pass
        assert not tails
        return made

    count = cuda_jit.programmatic_edges()
    assert launch((5, [0x100]), (5, [0x200])) is False       # after a torch kernel
    assert launch((5, [0x200]), (5, [0x300])) is True        # after ours
    assert edges == [(0x200, bytes([1, 0, 1, 0, 0, 0, 0, 0]), 1, 1)]
    assert launch((5, [0x300, 0x100]), (5, [0x400])) is False  # a join
    assert launch((6, [0x300]), (6, [0x500])) is False       # the same node, another capture
    assert launch(None, None) is False                        # eager
    assert len(edges) == 1 and cuda_jit.programmatic_edges() == count + 1


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
