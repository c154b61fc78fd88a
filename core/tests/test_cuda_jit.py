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


class _FakeCapture:
    """A stand-in for the two driver calls ``programmatic_dependent`` makes, as C function
    pointers with the driver's prototypes (so the real ctypes marshalling runs): a capture
    whose tail the test sets, and the log of dependency updates (which set the tail's edge)."""

    def __init__(self) -> None:
        import ctypes

        from kernelbay.cuda_jit import _EdgeData

        self.capturing = True
        self.capture = 2**63 + 5
        self.nodes: list[int] = []
        self.edge: bytes | None = None  # the tail's edge data; None: default
        self.updates: list[tuple[int, bytes | None, int, int]] = []
        c = ctypes
        query = c.CFUNCTYPE(c.c_int, c.c_void_p, c.POINTER(c.c_int), c.POINTER(c.c_uint64),
                            c.POINTER(c.c_void_p), c.POINTER(c.POINTER(c.c_void_p)),
                            c.POINTER(c.POINTER(_EdgeData)), c.POINTER(c.c_size_t))
        update = c.CFUNCTYPE(c.c_int, c.c_void_p, c.POINTER(c.c_void_p), c.POINTER(_EdgeData),
                             c.c_size_t, c.c_uint)
        self.cuStreamGetCaptureInfo_v3 = query(self._query)
        self.cuStreamUpdateCaptureDependencies_v2 = update(self._update)
        self._keep: list[object] = []

    def _query(self, stream, status, capture, graph, nodes, edges, count):  # type: ignore[no-untyped-def]
        import ctypes

        from kernelbay.cuda_jit import _EdgeData

        assert stream == 0xABC
        status[0] = 1 if self.capturing else 0
        capture[0] = self.capture
        array = (ctypes.c_void_p * max(1, len(self.nodes)))(*self.nodes)
        nodes[0] = ctypes.cast(array, ctypes.POINTER(ctypes.c_void_p))
        data = (_EdgeData * max(1, len(self.nodes)))()
        if self.edge is not None:
            ctypes.memmove(data, self.edge, 8)
        edges[0] = (ctypes.cast(data, ctypes.POINTER(_EdgeData)) if self.edge is not None
                    else ctypes.POINTER(_EdgeData)())
        self._keep += [array, data]
        count[0] = len(self.nodes)
        return 0

    def _update(self, stream, nodes, edge, count, flags):  # type: ignore[no-untyped-def]
        import ctypes

        data = ctypes.string_at(ctypes.addressof(edge.contents), 8) if edge else None
        self.updates.append((nodes[0], data, count, flags))
        self.nodes, self.edge = [nodes[0]], data
        return 0


def test_programmatic_dependent_links_only_launches_made_through_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Through a stand-in driver: a launch after a node not made here (a torch kernel) stays
    plain and is recorded; the next one gets one programmatic edge from exactly that node;
    an edge with data already on it, a join, ``depend=False``, another capture and no capture
    at all keep the plain edge; a launch that adds no node or raises gets the plain edge back
    and is not counted; only the last eight captures are remembered."""
    from kernelbay import cuda_jit

    fake = _FakeCapture()
    monkeypatch.setattr(cuda_jit, "_cuda", lambda: fake)
    monkeypatch.setattr(cuda_jit, "_capture_query", lambda: fake.cuStreamGetCaptureInfo_v3)
    monkeypatch.setattr(cuda_jit, "_releasing", {})
    programmatic = bytes([1, 0, 1, 0, 0, 0, 0, 0])

    def launch(before: list[int], added: int | None, *, depend: bool = True) -> bool:
        fake.nodes, fake.edge = list(before), None
        with cuda_jit.programmatic_dependent(0xABC, depend=depend) as made:
            if added is not None:
                fake.nodes, fake.edge = [added], None
        return made

    count = cuda_jit.programmatic_edges()
    assert launch([0x100], 0x200) is False                     # after a torch kernel
    assert launch([0x200], 0x300) is True                      # after ours
    assert fake.updates == [(0x200, programmatic, 1, 1)]
    assert cuda_jit.programmatic_edges() == count + 1
    fake.nodes, fake.edge = [0x300], programmatic               # an edge with data on it
    with cuda_jit.programmatic_dependent(0xABC) as made:
        fake.nodes, fake.edge = [0x310], None
    assert made is False
    assert launch([0x300, 0x100], 0x400) is False              # a join
    assert launch([0x300], 0x500, depend=False) is False       # a sum after its GEMM
    assert launch([0x500], None) is True                       # an empty grid: no node
    assert fake.updates[-1] == (0x500, None, 1, 1) and fake.nodes == [0x500]
    with pytest.raises(RuntimeError, match="launch failed"), \
            cuda_jit.programmatic_dependent(0xABC):
        raise RuntimeError("launch failed")
    assert fake.updates[-1] == (0x500, None, 1, 1) and len(fake.updates) == 5
    assert cuda_jit.programmatic_edges() == count + 1
    fake.capture += 1
    assert launch([0x500], 0x600) is False                     # another capture
    fake.capturing = False
    assert launch([0x600], 0x700) is False                     # eager
    assert len(fake.updates) == 5
    fake.capturing = True
    first = fake.capture - 1
    for _ in range(8):
        fake.capture += 1
        launch([0x1], 0x2)
    assert first not in cuda_jit._releasing and len(cuda_jit._releasing) == 8


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
