"""Compile the C++ kernels on first use and cache the built extension per user.

The extension is built with ``torch.utils.cpp_extension.load`` (ninja + the C++ compiler)
into ``<cache>/cpu_amx/<key>/``, where ``<cache>`` is ``$KERNELBAY_CACHE_DIR`` or
``$XDG_CACHE_HOME/kernelbay`` or ``~/.cache/kernelbay`` and ``<key>`` hashes the sources, the
compiler flags, the torch version and the Python ABI: a new torch or an edited kernel builds a
new entry, an old one is never reused by mistake.

Concurrent first use (two processes, two test workers) is safe: builders serialise on a lock
file next to the entry, each build happens in a private temporary folder that is renamed into
place only once complete, so a reader sees either nothing or a finished build, never a half
written one. A build killed midway leaves only a ``.build-*`` folder, which nothing reads.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import os
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

from kernelbay.cache import cache_dir
from kernelbay.errors import KernelbayError

__all__ = [
    "CFLAGS",
    "LDFLAGS",
    "SOURCES",
    "ExtensionBuildError",
    "build_key",
    "cache_root",
    "cached_build",
    "extension_dir",
    "find_ninja",
    "load_extension",
]

#: Files compiled into the extension (the header counts for the cache key).
SOURCES = ("check.h", "fp8_linear.h", "kernels_impl.h", "linear_base.cpp", "linear_vbmi.cpp",
           "linear_amx.cpp", "bindings.cpp")
#: ISA flags: AVX512-BF16 is required at run time; AMX code is compiled in and used only when
#: the CPU and the OS allow it (linear_amx.cpp). -fopenmp makes at::parallel_for parallel and
#: links the libgomp torch already loaded (same soname), so torch.set_num_threads applies.
CFLAGS = ("-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl",
          "-mavx512dq", "-mavx512bf16", "-mfma", "-mamx-tile", "-mamx-bf16")
LDFLAGS = ("-fopenmp",)

_CSRC = Path(__file__).resolve().parent / "csrc"
_ENTRY_PREFIX = "kernelbay_cpu_amx_ext_"


class ExtensionBuildError(KernelbayError, RuntimeError):
    """The C++ kernels could not be compiled or loaded; the message says what is missing."""


def cache_root() -> Path:
    """The core's cache folder (``kernelbay.cache.cache_dir``)."""
    return cache_dir()


def build_key() -> str:
    """Hash of everything the built binary depends on: sources, flags, torch, Python ABI."""
    import torch

    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update(name.encode())
        digest.update((_CSRC / name).read_bytes())
    parts = (*CFLAGS, "|", *LDFLAGS, "|", torch.__version__, str(torch.version.git_version),
             sys.implementation.cache_tag or "", str(sysconfig.get_config_var("EXT_SUFFIX")),
             os.environ.get("CXX", "c++"))
    digest.update("\0".join(parts).encode())
    return digest.hexdigest()[:20]


def extension_dir(key: str | None = None) -> Path:
    """The cache entry of this build: ``<cache_root>/cpu_amx/<key>``."""
    return cache_root() / "cpu_amx" / (key or build_key())


def find_ninja() -> str | None:
    """Path of a ninja executable: on PATH, next to this Python, or from the ``ninja`` wheel."""
    found = shutil.which("ninja") or shutil.which("ninja", path=os.path.dirname(sys.executable))
    if found:
        return found
    with contextlib.suppress(ImportError, AttributeError):
        import ninja  # the PyPI package ships the binary in BIN_DIR

        found = shutil.which("ninja", path=str(ninja.BIN_DIR))
    return found


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock (fcntl.flock) held while the block runs."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def cached_build(final: Path, artifact: str, build: Callable[[Path], None]) -> Path:
    """Return ``final / artifact``, building it first if the entry does not exist yet.

    ``build(tmp)`` must write ``artifact`` into the empty folder ``tmp``; the folder is then
    renamed to ``final`` (atomic on one file system). Builders of one entry take turns on
    ``final.lock``; whoever comes second finds the entry made and builds nothing.
    """
    target = final / artifact
    if target.exists():
        return target
    with _file_lock(final.parent / f"{final.name}.lock"):
        if target.exists():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".build-{final.name}-", dir=final.parent))
        try:
            build(tmp)
            if not (tmp / artifact).exists():
                raise ExtensionBuildError(f"the build wrote no {artifact!r} into {tmp}")
            if final.exists():  # a stale, incomplete entry from an older layout: replace it
                shutil.rmtree(final)
            os.replace(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def _compile(name: str, tmp: Path) -> ModuleType:
    from torch.utils import cpp_extension

    ninja = find_ninja()
    if ninja is None:
        raise ExtensionBuildError(
            "kernelbay-cpu-amx compiles its C++ kernels on first use and needs ninja, which "
            f"was found neither on PATH ({os.environ.get('PATH', '')!r}) nor next to "
            f"{sys.executable!r} nor in a 'ninja' Python package; install it with "
            "`pip install ninja`")
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise ExtensionBuildError(
            f"kernelbay-cpu-amx compiles its C++ kernels on first use and needs a C++ compiler "
            f"(g++ >= 11 or clang >= 12 for the AVX512-BF16/AMX intrinsics); {compiler!r} is "
            "not on PATH (set CXX to choose another)")
    print(f"kernelbay-cpu-amx: compiling the AVX512-BF16/AMX kernels once (about a minute) "
          f"into {tmp.parent}", file=sys.stderr, flush=True)
    old_path = os.environ.get("PATH", "")
    os.environ["PATH"] = os.path.dirname(ninja) + os.pathsep + old_path
    try:
        module = cpp_extension.load(
            name=name,
            sources=[str(_CSRC / s) for s in SOURCES if s.endswith(".cpp")],
            extra_cflags=list(CFLAGS),
            extra_ldflags=list(LDFLAGS),
            build_directory=str(tmp),
            is_python_module=True,
            verbose=False,
        )
    except (RuntimeError, OSError) as exc:
        raise ExtensionBuildError(
            f"compiling the kernelbay-cpu-amx kernels with {compiler!r} failed (flags "
            f"{' '.join(CFLAGS)}); the compiler said:\n{exc}") from exc
    finally:
        os.environ["PATH"] = old_path
    if not isinstance(module, ModuleType):
        raise ExtensionBuildError(f"the build of {name!r} returned {module!r}, not a module")
    return module


def _import(name: str, path: Path) -> ModuleType:
    import torch  # noqa: F401  (the extension links against libtorch: load it first)

    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ExtensionBuildError(f"cannot load the built kernels from {path}")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as exc:
        raise ExtensionBuildError(f"loading the built kernels from {path} failed: {exc}; "
                                  f"delete {path.parent} to rebuild") from exc
    sys.modules[name] = module
    return module


@functools.lru_cache(maxsize=1)
def load_extension() -> ModuleType:
    """The compiled kernels, built into the cache on first use (one line on stderr)."""
    key = build_key()
    name = _ENTRY_PREFIX + key
    suffix = str(sysconfig.get_config_var("EXT_SUFFIX") or ".so")
    # cpp_extension names the library <name>.so whatever the interpreter's EXT_SUFFIX.
    artifact = f"{name}.so" if sys.platform != "win32" else f"{name}{suffix}"
    built: list[ModuleType] = []
    path = cached_build(extension_dir(key), artifact,
                        lambda tmp: built.append(_compile(name, tmp)))
    if built:  # compiled (and already imported) by this process: don't load it a second time
        module = built[0]
        module.__file__ = str(path)
        sys.modules[name] = module
        return module
    return _import(name, path)
