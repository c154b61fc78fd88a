"""Building and caching the extension: where it goes, when it rebuilds, concurrent first use,
and the errors when a tool is missing. The compiler is faked here (a real build is the
session fixture ``ext``)."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path
from types import ModuleType

import pytest
from kernelbay_cpu_amx import _build

# Not imported from cpu_amx_helpers: the racing subprocesses re-import this module, and
# should not pay for importing torch.
KERNEL_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")


def test_cache_root_order(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("KERNELBAY_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert _build.cache_root() == tmp_path / "home" / ".cache" / "kernelbay"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _build.cache_root() == tmp_path / "xdg" / "kernelbay"
    monkeypatch.setenv("KERNELBAY_CACHE_DIR", str(tmp_path / "explicit"))
    assert _build.cache_root() == tmp_path / "explicit"
    key = _build.build_key()
    assert _build.extension_dir() == tmp_path / "explicit" / "cpu_amx" / key


def test_key_covers_flags_torch_and_sources(monkeypatch: pytest.MonkeyPatch,
                                            tmp_path: Path) -> None:
    import torch

    base = _build.build_key()
    assert base == _build.build_key() and len(base) == 20
    monkeypatch.setattr(_build, "CFLAGS", (*_build.CFLAGS, "-DEXTRA"))
    assert _build.build_key() != base
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__version__", "0.0.0+other")
    assert _build.build_key() != base
    monkeypatch.undo()
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    for name in _build.SOURCES:
        (csrc / name).write_bytes((_build._CSRC / name).read_bytes())
    monkeypatch.setattr(_build, "_CSRC", csrc)
    assert _build.build_key() == base
    (csrc / "kernels_impl.h").write_text("// edited\n", encoding="utf-8")
    assert _build.build_key() != base


def _fake_build(tmp: Path, log: Path, delay: float = 0.0) -> None:
    with open(log, "a", encoding="utf-8") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(delay)
    (tmp / "half-written").write_text("x", encoding="utf-8")
    time.sleep(delay)
    (tmp / "ext.so").write_text(f"built by {os.getpid()}", encoding="utf-8")


def test_cached_build_builds_once(tmp_path: Path) -> None:
    final = tmp_path / "cpu_amx" / "key"
    log = tmp_path / "log"
    first = _build.cached_build(final, "ext.so", lambda tmp: _fake_build(tmp, log))
    second = _build.cached_build(final, "ext.so", lambda tmp: _fake_build(tmp, log))
    assert first == second == final / "ext.so"
    assert len(log.read_text(encoding="utf-8").split()) == 1
    assert not [p for p in final.parent.iterdir() if p.name.startswith(".build-")]


def test_failed_build_leaves_no_entry(tmp_path: Path) -> None:
    final = tmp_path / "cpu_amx" / "key"

    def broken(tmp: Path) -> None:
        (tmp / "half-written").write_text("x", encoding="utf-8")
        raise _build.ExtensionBuildError("the compiler said no")

    with pytest.raises(_build.ExtensionBuildError, match="the compiler said no"):
        _build.cached_build(final, "ext.so", broken)
    assert not final.exists()
    assert not [p for p in final.parent.iterdir() if p.name.startswith(".build-")]
    with pytest.raises(_build.ExtensionBuildError, match=r"wrote no 'ext\.so'"):
        _build.cached_build(final, "ext.so", lambda tmp: None)


def _racer(final: str, log: str, barrier: object, out: object) -> None:
    barrier.wait()  # type: ignore[attr-defined]
    path = _build.cached_build(Path(final), "ext.so",
                               lambda tmp: _fake_build(tmp, Path(log), delay=0.2))
    out.put(Path(path).read_text(encoding="utf-8"))  # type: ignore[attr-defined]


def test_concurrent_first_use_builds_once(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    final, log = tmp_path / "cpu_amx" / "key", tmp_path / "log"
    barrier, out = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_racer, args=(str(final), str(log), barrier, out))
             for _ in range(3)]
    for p in procs:
        p.start()
    seen = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    builders = log.read_text(encoding="utf-8").split()
    assert len(builders) == 1, builders          # one build, the others waited on the lock
    assert len(set(seen)) == 1                   # and all read the same complete artifact
    assert sorted(p.name for p in final.iterdir()) == ["ext.so", "half-written"]


def test_missing_ninja_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(_build, "find_ninja", lambda: None)
    with pytest.raises(_build.ExtensionBuildError,
                       match=r"needs ninja, which was found neither on PATH .* `pip install "
                             r"ninja`"):
        _build._compile("kb_test_ext", tmp_path)


def test_missing_compiler_is_a_clear_error(monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    with pytest.raises(_build.ExtensionBuildError,
                       match=r"'no-such-compiler-xyz' is not on PATH"):
        _build._compile("kb_test_ext", tmp_path)


def test_compiling_prints_one_line_and_wraps_failures(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from torch.utils import cpp_extension

    def failing_load(**kwargs: object) -> ModuleType:
        raise RuntimeError("Error building extension: fp8_linear.h:1: error: boom")

    monkeypatch.setattr(cpp_extension, "load", failing_load)
    with pytest.raises(_build.ExtensionBuildError, match=r"(?s)failed .*boom"):
        _build._compile("kb_test_ext", tmp_path)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "compiling" in err and str(tmp_path.parent) in err


@pytest.mark.cpu_isa(*KERNEL_FLAGS)
def test_loaded_extension_lives_in_the_cache(ext: ModuleType) -> None:
    assert Path(ext.__file__).parent == _build.extension_dir()
    assert Path(ext.__file__).exists()
