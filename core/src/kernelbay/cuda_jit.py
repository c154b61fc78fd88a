"""CUDA C++ kernels built at run time: NVRTC compiles the source to a cubin for the device
(cached on disk), the driver API loads and launches it on torch's current stream.

Shared by every plugin that ships CUDA sources. Nothing here is imported by ``import
kernelbay`` or during discovery: a method imports it when it builds. Both libraries are found without a CUDA toolkit: ``libcuda`` comes with the driver,
``libnvrtc`` with CUDA builds of torch (the ``nvidia-cuda-nvrtc`` wheel, or a toolkit's
``lib64``). Loading goes through ``ctypes`` only, so this module neither links against torch
nor needs ``nvcc``.

Every source may ``#include "kernelbay/ptx.cuh"`` (PTX wrappers for asynchronous and bulk
copies, mbarriers, shared-memory loads and stores; ``HEADERS``), handed to NVRTC from memory.
The cache key is the source, the headers, the options, the architecture and the NVRTC
version; a cubin is written to a temporary file and renamed, so concurrent processes never
read half a file.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import glob
import hashlib
import os
import sys
import threading
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kernelbay.cache import cache_dir as _cache_root

__all__ = ["HEADERS", "TENSOR_MAP_DTYPES", "CudaJitError", "Kernel", "cache_dir",
           "compile_cubin", "find_nvrtc", "headers", "load_kernel", "nvrtc_available",
           "programmatic_dependent", "programmatic_edge", "programmatic_edges",
           "programmatic_launch", "tensor_map_2d"]

#: The headers every compile can include, by include name, and their files in this package.
HEADERS = {"kernelbay/ptx.cuh": "ptx.cuh"}


class CudaJitError(RuntimeError):
    """A CUDA source did not compile or a cubin did not load or launch (with the log)."""


def cache_dir() -> str:
    """Where cubins are kept: the ``cuda`` folder of ``kernelbay.cache.cache_dir`` (set
    ``KERNELBAY_CACHE_DIR`` to move it)."""
    return str(_cache_root("cuda"))


def _nvrtc_candidates() -> list[str]:
    found: list[str] = []
    for base in sys.path:
        pattern = os.path.join(base, "nvidia", "**", "libnvrtc.so*")
        found += sorted(glob.glob(pattern, recursive=True))
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    found += sorted(glob.glob(os.path.join(home, "lib64", "libnvrtc.so*")))
    # the builtins library and the alternative ABI build are not the compiler's entry points
    return [p for p in found if "builtins" not in os.path.basename(p)
            and ".alt." not in os.path.basename(p)]


@functools.cache
def find_nvrtc() -> str | None:
    """The path of ``libnvrtc`` (``None`` when there is none), looked up on disk and not
    loaded: planning asks this, and a 100 MB library has no business loading then."""
    for path in _nvrtc_candidates():
        if os.path.exists(path):
            return path
    return ctypes.util.find_library("nvrtc")


def nvrtc_available() -> bool:
    """Whether NVRTC is installed (looked up, not loaded, nothing compiled)."""
    return find_nvrtc() is not None


@functools.cache
def _nvrtc() -> ctypes.CDLL:
    path = find_nvrtc()
    if path is None:
        raise CudaJitError("NVRTC not found: install a CUDA build of torch (it brings the "
                           "nvidia-cuda-nvrtc wheel) or a CUDA toolkit; searched nvidia/ "
                           "under sys.path, $CUDA_HOME/lib64 and the system's libraries")
    try:
        lib = ctypes.CDLL(path)
    except OSError as exc:
        raise CudaJitError(f"NVRTC at {path} does not load: {exc}") from exc
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    return lib


def _nvrtc_check(result: int, what: str) -> None:
    if result != 0:
        text = _nvrtc().nvrtcGetErrorString(result).decode()
        raise CudaJitError(f"NVRTC {what} failed: {text} ({result})")


@functools.cache
def nvrtc_version() -> tuple[int, int]:
    """NVRTC's (major, minor)."""
    major, minor = ctypes.c_int(), ctypes.c_int()
    _nvrtc_check(_nvrtc().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "version")
    return major.value, minor.value


@functools.cache
def headers() -> dict[str, str]:
    """The text of each of ``HEADERS`` by include name (read once from the package)."""
    from importlib import resources

    folder = resources.files("kernelbay") / "cuda"
    return {include: (folder / file).read_text(encoding="utf-8")
            for include, file in HEADERS.items()}


def compile_cubin(source: str, name: str, arch: str, options: Sequence[str] = ()) -> bytes:
    """``source`` compiled by NVRTC for ``arch`` (``"sm_90"``), with ``HEADERS`` includable:
    the cubin's bytes, from the disk cache when the same source, headers, options,
    architecture and NVRTC were built before. ``CudaJitError`` with the compiler's log when
    it does not compile."""
    opts = [f"--gpu-architecture={arch}", "--std=c++17", *options]
    includes = headers()
    parts = [source, name, *opts, str(nvrtc_version())]
    for include, text in sorted(includes.items()):
        parts += [include, text]
    key = hashlib.sha256("\0".join(parts).encode())
    path = os.path.join(cache_dir(), f"{name}-{arch}-{key.hexdigest()[:24]}.cubin")
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        pass
    lib = _nvrtc()
    prog = ctypes.c_void_p()
    texts = (ctypes.c_char_p * len(includes))(*[t.encode() for t in includes.values()])
    names = (ctypes.c_char_p * len(includes))(*[n.encode() for n in includes])
    _nvrtc_check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(),
                                        f"{name}.cu".encode(), len(includes), texts, names),
                 "create")
    try:
        argv = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        result = lib.nvrtcCompileProgram(prog, len(opts), argv)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        if result != 0:
            raise CudaJitError(f"NVRTC could not compile {name} for {arch} with {opts}:\n"
                               f"{log.value.decode(errors='replace')}")
        _nvrtc_check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "cubin size")
        cubin = ctypes.create_string_buffer(size.value)
        _nvrtc_check(lib.nvrtcGetCUBIN(prog, cubin), "cubin")
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
    data = cubin.raw
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        os.makedirs(cache_dir(), exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as exc:  # a read-only or full cache costs a compile per process, no more
        with contextlib.suppress(OSError):
            os.remove(tmp)
        warnings.warn(f"kernelbay: could not cache {name}'s cubin in {cache_dir()} ({exc}); "
                      "set KERNELBAY_CACHE_DIR to a writable folder", RuntimeWarning, stacklevel=2)
    return data


@functools.cache
def _cuda() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    _cu_check(lib, lib.cuInit(0), "cuInit")
    return lib


def _cu_check(lib: ctypes.CDLL, result: int, what: str) -> None:
    if result != 0:
        text = ctypes.c_char_p()
        lib.cuGetErrorString(result, ctypes.byref(text))
        raise CudaJitError(f"CUDA driver {what} failed: "
                           f"{(text.value or b'unknown error').decode()} ({result})")


def _primary_context(device: int) -> ctypes.c_void_p:
    """The device's primary context (the one torch's runtime calls use)."""
    lib = _cuda()
    dev = ctypes.c_int()
    _cu_check(lib, lib.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
    ctx = ctypes.c_void_p()
    _cu_check(lib, lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "primary context")
    return ctx


@contextlib.contextmanager
def _current(ctx: ctypes.c_void_p) -> Iterator[None]:
    """``ctx`` current on this thread for the block; the thread's own context is restored
    after (pushed and popped only when it differs, so torch never finds another device's
    context left current)."""
    lib = _cuda()
    current = ctypes.c_void_p()
    _cu_check(lib, lib.cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
    if current.value == ctx.value:
        yield
        return
    _cu_check(lib, lib.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
    try:
        yield
    finally:
        popped = ctypes.c_void_p()
        lib.cuCtxPopCurrent(ctypes.byref(popped))


class _EdgeData(ctypes.Structure):
    # CUgraphEdgeData: the upstream node's port, the downstream port, the dependency type,
    # five reserved bytes.
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte),
                ("type", ctypes.c_ubyte), ("reserved", ctypes.c_ubyte * 5)]


#: CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC (the upstream kernel's blocks have all released or
#: exited) and CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC (the downstream kernel may start then and
#: waits in griddepcontrol.wait for the upstream one to finish).
_PORT_PROGRAMMATIC = 1
_TYPE_PROGRAMMATIC = 1
#: CU_STREAM_CAPTURE_STATUS_ACTIVE and CU_STREAM_SET_CAPTURE_DEPENDENCIES.
_CAPTURE_ACTIVE = 1
_SET_DEPENDENCIES = 1


def programmatic_edge() -> _EdgeData:
    """The edge data of a programmatic dependency between two kernel nodes."""
    return _EdgeData(_PORT_PROGRAMMATIC, 0, _TYPE_PROGRAMMATIC)


#: Graph nodes of launches that release their dependents (grid_dependents_launch on every
#: path), by stream-capture id, in the order the captures were first seen; only the latest
#: few captures are kept.
_releasing: dict[int, set[int]] = {}
_releasing_lock = threading.Lock()
_KEPT_CAPTURES = 8
#: Programmatic edges made so far in this process (tests read it through programmatic_edges).
_edges_made = 0


def programmatic_edges() -> int:
    """How many launches this process made programmatic dependents of the kernel node before
    them (``programmatic_dependent``), for tests and benchmarks."""
    return _edges_made


@dataclass(frozen=True)
class _CaptureTail:
    """Where a capture stands: its id, the nodes the next captured node will depend on, and
    whether every one of those edges carries default data."""

    capture: int
    nodes: tuple[int, ...]
    plain: bool


@functools.cache
def _capture_query() -> Any:
    """The driver's ``cuStreamGetCaptureInfo_v3`` (CUDA 12.3+), or None."""
    return getattr(_cuda(), "cuStreamGetCaptureInfo_v3", None)


def _capture_tail(stream: int) -> _CaptureTail | None:
    """Where the capture on ``stream`` stands, or None when ``stream`` is not capturing (or the
    driver predates CUDA 12.3's query)."""
    query = _capture_query()
    if query is None:
        return None
    status, capture = ctypes.c_int(), ctypes.c_uint64()
    graph, count = ctypes.c_void_p(), ctypes.c_size_t()
    nodes = ctypes.POINTER(ctypes.c_void_p)()
    edges = ctypes.POINTER(_EdgeData)()
    if query(ctypes.c_void_p(stream), ctypes.byref(status), ctypes.byref(capture),
             ctypes.byref(graph), ctypes.byref(nodes), ctypes.byref(edges),
             ctypes.byref(count)) != 0 or status.value != _CAPTURE_ACTIVE:
        return None
    n = count.value
    # no edge data array: every edge is a default one
    plain = not edges or all(bytes(edges[i]) == bytes(8) for i in range(n))
    return _CaptureTail(capture.value, tuple(int(nodes[i] or 0) for i in range(n)), plain)


def _set_capture_dependency(stream: int, node: int, edge: _EdgeData | None) -> None:
    """Make ``node`` the one node the next node captured on ``stream`` depends on, through
    ``edge`` (None: a plain edge)."""
    lib = _cuda()
    _cu_check(lib, lib.cuStreamUpdateCaptureDependencies_v2(
        ctypes.c_void_p(stream), (ctypes.c_void_p * 1)(node),
        ctypes.byref(edge) if edge is not None else None, ctypes.c_size_t(1),
        ctypes.c_uint(_SET_DEPENDENCIES)), "programmatic capture dependency")


@contextlib.contextmanager
def programmatic_dependent(stream: int, *, depend: bool = True) -> Iterator[bool]:
    """Around the launch of a kernel that waits (``grid_dependency_wait``) before it touches
    memory and releases (``grid_dependents_launch``) on every path. While ``stream`` is
    captured into a CUDA graph and the node before is such a launch made here (one node, a
    plain edge), the new node depends on it programmatically (it may start once every block
    of that kernel released, and waits for its end in ``grid_dependency_wait``); the value
    says whether it does. Any other predecessor (a torch kernel, a copy, a join of streams,
    nothing) keeps the plain edge, and launches outside a capture stay plain: a programmatic
    edge from a kernel that never releases only costs (measured:
    ``bench/results/nvfp4-pdl-graph-edges-h200.md``). ``depend=False`` keeps the plain edge
    whatever came before (a split-K sum after its GEMM: slower as its dependent). The node
    the launch added is then recorded as one that releases; a launch that added none (an
    empty grid) or raised gets the plain edge back, so nothing after it inherits the
    programmatic one."""
    global _edges_made
    before = _capture_tail(stream)
    made = False
    if before is not None and depend and before.plain and len(before.nodes) == 1:
        with _releasing_lock:
            after_ours = before.nodes[0] in _releasing.get(before.capture, ())
        if after_ours:
            _set_capture_dependency(stream, before.nodes[0], programmatic_edge())
            made = True
    launched = False
    try:
        yield made
        launched = True
    finally:
        after = _capture_tail(stream) if before is not None else None
        added = (after is not None and before is not None and len(after.nodes) == 1
                 and after.nodes != before.nodes)
        if made and not (launched and added):
            assert before is not None
            _set_capture_dependency(stream, before.nodes[0], None)
        if after is not None and launched and added:
            with _releasing_lock:
                if made:
                    _edges_made += 1
                _releasing.setdefault(after.capture, set()).add(after.nodes[0])
                while len(_releasing) > _KEPT_CAPTURES:
                    del _releasing[next(iter(_releasing))]


def programmatic_launch(device: int | None = None) -> bool:
    """Whether kernels that support it may become programmatic dependents of the kernel
    before them (on by default; ``KERNELBAY_PDL=0`` turns it off, ``1`` or unset leaves it
    on; ``programmatic_dependent`` decides per launch), and, given a CUDA ``device`` index,
    whether that device can (compute capability 9.0 and newer; callers that choose a build by
    it ask so; ``Kernel.launch`` launches plainly below). Read at every call, so a process may
    switch it."""
    value = os.environ.get("KERNELBAY_PDL", "1")
    if value not in ("", "0", "1"):
        raise ValueError(f"KERNELBAY_PDL={value!r}; valid: '1' (on, the default) or '0' (off)")
    if value == "0":
        return False
    if device is None:
        return True
    try:
        return _compute_major(device) >= 9
    except (OSError, CudaJitError):  # no NVIDIA driver (a ROCm build): plain launches
        return False


@functools.cache
def _compute_major(device: int) -> int:
    """The compute capability's major number of CUDA ``device`` (from the driver)."""
    lib = _cuda()
    dev, major = ctypes.c_int(), ctypes.c_int()
    _cu_check(lib, lib.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
    # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
    _cu_check(lib, lib.cuDeviceGetAttribute(ctypes.byref(major), 75, dev),
              "compute capability")
    return major.value


#: CUfunction attributes read by ``Kernel.attribute``.
ATTRIBUTES = {"registers": 4, "shared_bytes": 1, "local_bytes": 3, "max_threads": 0}


@dataclass
class Kernel:
    """One loaded ``__global__`` function on one device; ``launch`` puts it on a stream."""

    device: int
    module: ctypes.c_void_p
    function: ctypes.c_void_p
    context: ctypes.c_void_p
    _shared_limit: int = 48 * 1024

    def attribute(self, name: str) -> int:
        """A property of the compiled function (``ATTRIBUTES``: registers per thread, static
        shared memory, local memory per thread, the largest block)."""
        value = ctypes.c_int()
        lib = _cuda()
        _cu_check(lib, lib.cuFuncGetAttribute(ctypes.byref(value), ATTRIBUTES[name],
                                              self.function), f"attribute {name}")
        return value.value

    def set_max_dynamic_shared(self, size: int) -> None:
        """Allow launches with ``size`` bytes of dynamic shared memory (above 48 KB a
        function must opt in)."""
        if size > 48 * 1024 and size > self._shared_limit:
            lib = _cuda()
            with _current(self.context):
                _cu_check(lib, lib.cuFuncSetAttribute(self.function, 8, size),
                          f"dynamic shared memory of {size} bytes")
            self._shared_limit = size

    def launch(self, grid: tuple[int, int, int], block: tuple[int, int, int],
               args: Sequence[Any], stream: int, shared_bytes: int = 0, *,
               programmatic: bool = False) -> None:
        """Launch with ``args`` as ctypes values (``ctypes.c_void_p`` for pointers) on the
        CUDA stream handle ``stream`` (``torch.cuda.current_stream().cuda_stream``).
        ``programmatic``: the kernel waits in ``grid_dependency_wait`` (``kernelbay/ptx.cuh``)
        before it touches what the kernel before it reads or writes, and releases
        (``grid_dependents_launch``) on every path: captured into a CUDA graph right after
        another such launch, it becomes that node's programmatic dependent
        (``programmatic_dependent``); plain otherwise, and below compute capability 9.0."""
        lib = _cuda()
        params = (ctypes.c_void_p * len(args))(
            *[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args])
        dependent = (programmatic_dependent(stream)
                     if programmatic and _compute_major(self.device) >= 9
                     else contextlib.nullcontext())
        with _current(self.context), dependent:
            _cu_check(lib, lib.cuLaunchKernel(self.function, *grid, *block, shared_bytes,
                                              ctypes.c_void_p(stream), params, None),
                      "cuLaunchKernel")


#: Element types of ``tensor_map_2d`` and their CUtensorMapDataType codes.
TENSOR_MAP_DTYPES = {"uint8": 0, "uint16": 1, "uint32": 2, "int32": 3, "float16": 6,
                     "float32": 7, "bfloat16": 9}
_ELEMENT_BYTES = {"uint8": 1, "uint16": 2, "uint32": 4, "int32": 4, "float16": 2,
                  "float32": 4, "bfloat16": 2}
#: Shared-memory swizzle spans (bytes) and their CUtensorMapSwizzle codes.
_SWIZZLES = {0: 0, 32: 1, 64: 2, 128: 3}


def tensor_map_2d(address: int, dtype: str, rows: int, cols: int, row_stride_bytes: int,
                  box_rows: int, box_cols: int, swizzle: int = 128) -> ctypes.Array[Any]:
    """The TMA descriptor (CUtensorMap, 128 bytes) of a row-major 2-D tensor at device
    ``address`` whose boxes of ``box_rows`` x ``box_cols`` elements a kernel copies into
    shared memory (``bulk_tensor_2d`` of ``kernelbay/ptx.cuh``), swizzled over ``swizzle``
    bytes (0, 32, 64, 128); elements outside ``rows`` x ``cols`` arrive as zeros. Pass it to
    ``Kernel.launch`` for a ``const __grid_constant__`` 128-byte, 64-byte aligned parameter.
    It holds ``address``: encode one per tensor (a host-side call, no GPU work).
    ``ValueError`` names what the hardware would reject."""
    if dtype not in TENSOR_MAP_DTYPES:
        raise ValueError(f"tensor_map_2d: dtype {dtype!r}; valid: {sorted(TENSOR_MAP_DTYPES)}")
    if swizzle not in _SWIZZLES:
        raise ValueError(f"tensor_map_2d: swizzle {swizzle}; valid: {sorted(_SWIZZLES)}")
    size = _ELEMENT_BYTES[dtype]
    checks = [
        (address % 16 == 0, f"address {address:#x} must be 16-byte aligned"),
        (rows >= 1 and cols >= 1, f"shape {rows} x {cols} must be positive"),
        (row_stride_bytes % 16 == 0 and row_stride_bytes >= cols * size,
         f"row stride of {row_stride_bytes} bytes must be a multiple of 16 and hold a row "
         f"of {cols * size} bytes"),
        (1 <= box_rows <= 256 and 1 <= box_cols <= 256,
         f"box {box_rows} x {box_cols} must be 1..256 per side"),
        ((box_cols * size) % 16 == 0, f"a box row of {box_cols * size} bytes must be a "
         "multiple of 16"),
        (swizzle == 0 or box_cols * size <= swizzle,
         f"a box row of {box_cols * size} bytes must fit the {swizzle}-byte swizzle"),
    ]
    for ok, why in checks:
        if not ok:
            raise ValueError(f"tensor_map_2d: {why}")
    u64 = ctypes.c_uint64
    u32 = ctypes.c_uint32
    tensor_map = (u64 * 16)()
    lib = _cuda()
    _cu_check(lib, lib.cuTensorMapEncodeTiled(
        ctypes.byref(tensor_map), TENSOR_MAP_DTYPES[dtype], 2, ctypes.c_void_p(address),
        (u64 * 2)(cols, rows), (u64 * 1)(row_stride_bytes), (u32 * 2)(box_cols, box_rows),
        (u32 * 2)(1, 1), 0, _SWIZZLES[swizzle], 2, 0), "cuTensorMapEncodeTiled")
    return tensor_map


_LOADED: dict[tuple[int, bytes, str], Kernel] = {}
_LOCK = threading.Lock()


def load_kernel(cubin: bytes, name: str, device: int) -> Kernel:
    """The ``extern "C"`` function ``name`` of ``cubin`` loaded on CUDA ``device`` (once per
    process and device)."""
    key = (device, hashlib.sha256(cubin).digest(), name)
    with _LOCK:
        if key not in _LOADED:
            lib = _cuda()
            ctx = _primary_context(device)
            module = ctypes.c_void_p()
            function = ctypes.c_void_p()
            with _current(ctx):
                _cu_check(lib, lib.cuModuleLoadData(ctypes.byref(module), cubin),
                          f"loading the cubin of {name}")
                _cu_check(lib, lib.cuModuleGetFunction(ctypes.byref(function), module,
                                                       name.encode()), f"finding {name}")
            _LOADED[key] = Kernel(device, module, function, ctx)
        return _LOADED[key]
