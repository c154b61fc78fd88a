#!/usr/bin/env python3
"""kernelbay CI driver: one program that the Makefile, .ci/run and GitHub Actions all call.

Subcommands::

    setup            create/update the ONE shared third-party venv ($KERNELBAY_VENVS/_shared)
    jobs [--json]    print the job matrix, generated from the file system
    run JOB... | --all [--fail-fast] [-- PYTEST_ARGS]
                     per job: a fresh venv that sees the shared env through a .pth file, a real
                     (non-editable) wheel install of our packages, then pytest
    demo             setup + a fresh demo venv with core and all plugins, then run the CLI
    gha [--write | --check]
                     the GitHub Actions workflow generated from `jobs`

Environment:

    KERNELBAY_VENVS        directory of all venvs (default: <repo>/.venvs)
    KERNELBAY_CI_JOBS      comma-separated job names; restricts `run --all`
    KERNELBAY_GPU          1/0: force GPU detection on/off
    KERNELBAY_TORCH        torch requirement to install instead of the default choice
    KERNELBAY_TORCH_INDEX  extra index URL for the torch install (CI: the PyTorch CPU index)
    KERNELBAY_CI_TIMEOUT   seconds one job command may run (default 1200; 0 = no limit)

Standard library only; Python >= 3.10.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import venv
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

TORCH_CPU_PIN = "torch==2.13.0"  # a CPU build of this release is what pip finds without a GPU
TORCH_GPU_SPEC = "torch>=2.6"  # matches the core's metadata
SETUP_SCHEMA = "1"  # bump to invalidate every shared-env stamp
SHARED_NAME = "_shared"
STAMP_NAME = ".kernelbay-ci-stamp"
PTH_NAME = "_kernelbay_shared_env.pth"
REQUIREMENTS = Path("scripts/requirements-shared.txt")
WORKFLOW = Path(".github/workflows/ci.yml")
VENDOR_EXAMPLE = "examples/vendor_plugin"
DEFAULT_TIMEOUT_S = 1200.0  # per job command; KERNELBAY_CI_TIMEOUT overrides (0 = none)
TIMEOUT_RC = 124
# Job commands may use these placeholders; `run` substitutes them.
PY = "{python}"

# Status labels in the summary.
PASS = "pass"
FAIL = "FAIL"
NO_TESTS = "no tests"


# --------------------------------------------------------------------------------------------
# Small helpers


def log(msg: str = "") -> None:
    print(msg, flush=True)


def die(msg: str, code: int = 2) -> SystemExit:
    print(f"ci.py: error: {msg}", file=sys.stderr, flush=True)
    return SystemExit(code)


def fmt_s(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds >= 60:
        return f"{int(seconds // 60)}m{seconds % 60:04.1f}s"
    return f"{seconds:.1f}s"


def normalize(name: str) -> str:
    """PEP 503 normalized distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def venv_bin(venv_dir: Path) -> Path:
    return venv_dir / ("Scripts" if os.name == "nt" else "bin")


def venv_python(venv_dir: Path) -> Path:
    return venv_bin(venv_dir) / ("python.exe" if os.name == "nt" else "python")


def rel(path: Path, root: Path) -> str:
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return str(path)


def job_timeout() -> float | None:
    """Seconds one job command (pip install, one pytest run, ruff, mypy) may take; 0 = none."""
    raw = os.environ.get("KERNELBAY_CI_TIMEOUT", "").strip()
    try:
        value = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        raise die(f"KERNELBAY_CI_TIMEOUT must be a number of seconds, got {raw!r}") from None
    return value if value > 0 else None


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """End the command and everything it started (its own process group), by id."""
    if proc.poll() is not None:
        return
    if hasattr(os, "killpg"):
        for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(timeout=grace)
                return
            except subprocess.TimeoutExpired:
                continue
    proc.kill()


def run_cmd(
    argv: Sequence[str | Path],
    *,
    cwd: Path,
    env: Mapping[str, str] | None = None,
    capture: bool = False,
    timeout: float | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run a command; with capture, stdout+stderr come back merged in `.stdout`.

    With a timeout the command runs in its own process group, which is killed as a whole
    when time is up (exit status TIMEOUT_RC).
    """
    args = [str(a) for a in argv]
    proc = subprocess.Popen(
        args,
        cwd=cwd,
        env=None if env is None else dict(env),
        text=True,
        stdout=subprocess.PIPE if capture else None,
        stderr=subprocess.STDOUT if capture else None,
        start_new_session=timeout is not None and os.name != "nt",
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, _ = proc.communicate()
        log(f"-- timed out after {fmt_s(timeout)}: {shlex.join(args)}")
        return subprocess.CompletedProcess(args, TIMEOUT_RC, out, None)
    except BaseException:  # Ctrl-C: the child may sit in its own process group
        _kill_group(proc)
        proc.wait()
        raise
    return subprocess.CompletedProcess(args, proc.returncode, out, None)


# --------------------------------------------------------------------------------------------
# pyproject.toml reading (tomllib on 3.11+, a minimal fallback on 3.10)


@dataclasses.dataclass(frozen=True)
class ProjectMeta:
    name: str
    extras: frozenset[str]


def _parse_toml_minimal(text: str) -> tuple[str | None, set[str]]:
    """Just [project] name and the keys of [project.optional-dependencies]."""
    table = ""
    name: str | None = None
    extras: set[str] = set()
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        header = re.fullmatch(r"\[\s*([^\[\]]+?)\s*\]", line)
        if header:
            table = header.group(1).replace(" ", "")
            continue
        key = re.match(r"""^["']?([A-Za-z0-9_.-]+)["']?\s*=\s*(.*)$""", line)
        if not key:
            continue
        if table == "project" and key.group(1) == "name":
            value = re.match(r"""["']([^"']+)["']""", key.group(2))
            name = value.group(1) if value else None
        elif table == "project.optional-dependencies":
            extras.add(key.group(1))
    return name, extras


def read_project(pkg_dir: Path) -> ProjectMeta:
    pyproject = pkg_dir / "pyproject.toml"
    text = pyproject.read_text(encoding="utf-8")
    name: object
    extras: Iterable[str]
    if sys.version_info >= (3, 11):
        import tomllib

        project = tomllib.loads(text).get("project", {})
        name = project.get("name")
        extras = project.get("optional-dependencies", {}).keys()
    else:  # Python 3.10 has no tomllib
        name, extras = _parse_toml_minimal(text)
    if not isinstance(name, str) or not name:
        raise die(f"{pyproject}: [project] has no name")
    return ProjectMeta(name=name, extras=frozenset(normalize(e) for e in extras))


def installed_dists(site_dirs: Iterable[Path]) -> dict[str, str]:
    """Normalized name -> version of every distribution found directly in `site_dirs`."""
    found: dict[str, str] = {}
    for site in site_dirs:
        if not site.is_dir():
            continue
        for info in sorted(site.glob("*.dist-info")):
            meta = info / "METADATA"
            name, version = "", ""
            if meta.is_file():
                with meta.open(encoding="utf-8", errors="replace") as fh:
                    for line in fh:
                        if line.startswith("Name:"):
                            name = line.split(":", 1)[1].strip()
                        elif line.startswith("Version:"):
                            version = line.split(":", 1)[1].strip()
                        elif not line.strip():
                            break
            if not name:
                name, _, version = info.name[: -len(".dist-info")].partition("-")
            found[normalize(name)] = version
    return found


# --------------------------------------------------------------------------------------------
# The job matrix


@dataclasses.dataclass(frozen=True)
class Job:
    name: str
    description: str
    packages: tuple[str, ...] = ()  # package dirs (relative to the root) installed as wheels
    tests: tuple[str, ...] = ()  # test paths (relative to the root), one pytest run each
    commands: tuple[tuple[str, ...], ...] = ()  # other checks; "{python}" = the job's python

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "description": self.description,
            "packages": list(self.packages),
            "tests": list(self.tests),
            "commands": [list(c) for c in self.commands],
        }


def plugin_dirs(root: Path) -> list[Path]:
    """Every plugins/*/ directory that holds a pyproject.toml, sorted by name."""
    base = root / "plugins"
    if not base.is_dir():
        return []
    return sorted(d for d in base.iterdir() if d.is_dir() and (d / "pyproject.toml").is_file())


def _has_test_files(path: Path) -> bool:
    return path.is_dir() and any(
        p.name.startswith("test_") or p.name.endswith("_test.py") for p in path.rglob("*.py")
    )


def build_jobs(root: Path) -> list[Job]:
    """The job matrix, in the order `run --all` runs it (lint first, `all` last)."""
    plugins = [d.relative_to(root).as_posix() for d in plugin_dirs(root)]
    # every package's sources, typed strictly by the root pyproject's mypy config (whose
    # mypy_path finds the core for the plugins, none of which is installed in this job)
    typed = [f"{p}/src" for p in ("core", *plugins, VENDOR_EXAMPLE) if (root / p / "src").is_dir()]
    jobs = [
        Job(
            name="lint",
            description="ruff over the repo; mypy over the core, every plugin and the vendor "
            "example (root pyproject config)",
            commands=((PY, "-m", "ruff", "check", "."), (PY, "-m", "mypy", *typed)),
        ),
        Job(
            name="core",
            description="core alone",
            packages=("core",),
            tests=("core/tests",),
        ),
    ]
    for plugin in plugins:
        jobs.append(
            Job(
                name=f"plugin-{Path(plugin).name}",
                description=f"core + {plugin} only",
                packages=("core", plugin),
                tests=(f"{plugin}/tests",),
            )
        )
    jobs.append(
        Job(
            name="vendor-example",
            description=f"core + {VENDOR_EXAMPLE}",
            packages=("core", VENDOR_EXAMPLE),
            tests=(f"{VENDOR_EXAMPLE}/tests",),
        )
    )
    all_packages = ("core", *plugins, VENDOR_EXAMPLE)
    all_tests = ["tests", *(f"{p}/tests" for p in all_packages)]
    if _has_test_files(root / "bench"):  # bench smoke tests live in bench/test_*.py or tests/
        all_tests.append("bench")
    jobs.append(
        Job(
            name="all",
            description="core + every plugin + the vendor example; cross-package tests, "
            "every package's tests, bench smoke",
            packages=all_packages,
            tests=tuple(all_tests),
        )
    )
    return jobs


def select_jobs(
    jobs: Sequence[Job], names: Sequence[str], use_all: bool, env_filter: str | None
) -> list[Job]:
    by_name = {j.name: j for j in jobs}
    if use_all:
        wanted = [j.name for j in jobs]
        if env_filter:
            allowed = [n.strip() for n in env_filter.split(",") if n.strip()]
            unknown = [n for n in allowed if n not in by_name]
            if unknown:
                raise die(f"KERNELBAY_CI_JOBS names unknown jobs {unknown}; jobs: {list(by_name)}")
            wanted = [n for n in wanted if n in allowed]
    else:
        unknown = [n for n in names if n not in by_name]
        if unknown:
            raise die(f"unknown job(s) {unknown}; jobs: {list(by_name)}")
        wanted = list(dict.fromkeys(names))
    return [by_name[n] for n in wanted]


# --------------------------------------------------------------------------------------------
# Paths and context


@dataclasses.dataclass(frozen=True)
class Context:
    root: Path
    venvs: Path

    @property
    def shared(self) -> Path:
        return self.venvs / SHARED_NAME

    @classmethod
    def create(cls, root: Path) -> Context:
        venvs = os.environ.get("KERNELBAY_VENVS")
        return cls(
            root=root.resolve(),
            venvs=Path(venvs).resolve() if venvs else (root / ".venvs").resolve(),
        )

    def our_names(self) -> set[str]:
        """Normalized names of every distribution of ours found in the tree."""
        names = {"kernelbay"}
        dirs = [self.root / "core", *plugin_dirs(self.root)]
        examples = self.root / "examples"
        if examples.is_dir():
            dirs += [d for d in examples.iterdir() if (d / "pyproject.toml").is_file()]
        for d in dirs:
            if (d / "pyproject.toml").is_file():
                names.add(normalize(read_project(d).name))
        return names


def is_ours(name: str, ours: set[str]) -> bool:
    n = normalize(name)
    return n in ours or n == "kernelbay" or n.startswith("kernelbay-")


def site_dirs_of(python: Path) -> list[Path]:
    """purelib and platlib of the environment that `python` belongs to."""
    code = "import sysconfig as s; print(s.get_path('purelib')); print(s.get_path('platlib'))"
    out = subprocess.run(
        [str(python), "-I", "-c", code], text=True, capture_output=True, check=True
    ).stdout
    return list(dict.fromkeys(Path(line) for line in out.splitlines() if line.strip()))


def pth_text(shared_sites: Sequence[Path]) -> str:
    """Content of the .pth that makes the shared env's site-packages visible to a job venv.

    `site.addsitedir` (rather than a bare path line) also processes the shared env's own .pth
    files. The paths are appended after the job venv's own site-packages, so our freshly
    installed packages always win over anything in the shared env.
    """
    lines = ["# kernelbay CI: third-party packages come from the shared env (scripts/ci.py)"]
    lines += [f"import site; site.addsitedir({str(p)!r})" for p in shared_sites]
    return "\n".join(lines) + "\n"


def write_pth(job_site: Path, shared_sites: Sequence[Path]) -> Path:
    job_site.mkdir(parents=True, exist_ok=True)
    pth = job_site / PTH_NAME
    pth.write_text(pth_text(shared_sites), encoding="utf-8")
    return pth


def clean_env(venv_dir: Path | None, ctx: Context) -> dict[str, str]:
    """The environment for commands run inside a job venv: no leakage from the caller."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "VIRTUAL_ENV")
        # kernelbay policy variables (KERNELBAY_PLUGINS, _DEVICE, _FORCE_*...) of the caller's
        # shell must not change test outcomes.
        and not (k.startswith("KERNELBAY_") and not k.startswith("KERNELBAY_CI_"))
    }
    env["PYTHONNOUSERSITE"] = "1"
    env["KERNELBAY_CI_SHARED_VENV"] = str(ctx.shared)
    env["KERNELBAY_CI_REPO"] = str(ctx.root)
    # Build caches (compiled kernels, quantized demos) live in the checkout, so a fresh clone
    # builds them from scratch as a fresh machine would.
    env["KERNELBAY_CACHE_DIR"] = str(ctx.root / ".cache" / "kernelbay")
    if venv_dir is not None:
        env["VIRTUAL_ENV"] = str(venv_dir)
        env["PATH"] = str(venv_bin(venv_dir)) + os.pathsep + env.get("PATH", "")
    return env


def offline_pip_env(env: Mapping[str, str]) -> dict[str, str]:
    """pip sees only our local directories and what is already installed: no config, no index."""
    out = {k: v for k, v in env.items() if not k.startswith("PIP_")}
    out["PIP_CONFIG_FILE"] = os.devnull
    out["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return out


# --------------------------------------------------------------------------------------------
# setup: the shared third-party environment


def detect_gpu() -> bool:
    forced = os.environ.get("KERNELBAY_GPU")
    if forced is not None and forced.strip() != "":
        return forced.strip().lower() not in ("0", "false", "no", "off")
    if Path("/dev/nvidia0").exists():
        return True
    for tool in ("nvidia-smi", "rocm-smi"):
        exe = shutil.which(tool)
        if exe is None:
            continue
        try:
            done = subprocess.run([exe], capture_output=True, timeout=30, check=False)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if done.returncode == 0:
            return True
    return False


def torch_requirement(gpu: bool) -> str:
    """What to install for torch when none is kept: exact CPU pin without a GPU."""
    override = os.environ.get("KERNELBAY_TORCH", "").strip()
    if override:
        return override
    return TORCH_GPU_SPEC if gpu else TORCH_CPU_PIN


def setup_stamp(requirements: bytes, torch_choice: str, torch_index: str) -> str:
    h = hashlib.sha256()
    for part in (
        SETUP_SCHEMA.encode(),
        requirements,
        torch_choice.encode(),
        torch_index.encode(),
        platform.python_implementation().encode(),
        ".".join(map(str, sys.version_info[:3])).encode(),
        platform.machine().encode(),
    ):
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()


def venv_version(venv_dir: Path) -> str | None:
    cfg = venv_dir / "pyvenv.cfg"
    if not cfg.is_file():
        return None
    for line in cfg.read_text(encoding="utf-8").splitlines():
        key, _, value = line.partition("=")
        if key.strip() in ("version", "version_info"):
            return ".".join(value.strip().split(".")[:3])
    return None


def running_version() -> str:
    return ".".join(map(str, sys.version_info[:3]))


def create_venv(venv_dir: Path, *, with_pip: bool) -> None:
    if venv_dir.exists():
        shutil.rmtree(venv_dir)
    venv.EnvBuilder(with_pip=with_pip, symlinks=os.name != "nt", clear=True).create(venv_dir)


def pip_args(python: Path) -> list[str]:
    args = [str(python), "-m", "pip", "install", "--disable-pip-version-check"]
    if not sys.stdout.isatty():
        args += ["--progress-bar", "off"]
    return args


def remove_our_packages(ctx: Context, python: Path, sites: Sequence[Path]) -> None:
    ours = ctx.our_names()
    found = sorted(n for n in installed_dists(sites) if is_ours(n, ours))
    if found:
        log(f"  removing our own packages from the shared env (they belong in job venvs): {found}")
        done = run_cmd([python, "-m", "pip", "uninstall", "-y", *found], cwd=ctx.root)
        if done.returncode != 0:
            raise die("could not uninstall our packages from the shared env")


def cmd_setup(ctx: Context, force: bool = False) -> int:
    t0 = time.monotonic()
    req_file = ctx.root / REQUIREMENTS
    if not req_file.is_file():
        raise die(f"{req_file} is missing")
    gpu = detect_gpu()
    torch_req = torch_requirement(gpu)
    torch_index = os.environ.get("KERNELBAY_TORCH_INDEX", "").strip()
    stamp = setup_stamp(req_file.read_bytes(), f"gpu={gpu} {torch_req}", torch_index)
    shared = ctx.shared
    python = venv_python(shared)
    stamp_file = shared / STAMP_NAME
    log(f"== setup: shared env {shared} (gpu={'yes' if gpu else 'no'}, torch: {torch_req})")

    version_ok = venv_version(shared) == running_version()
    if (
        not force
        and python.exists()
        and version_ok
        and stamp_file.is_file()
        and stamp_file.read_text(encoding="utf-8").strip() == stamp
    ):
        remove_our_packages(ctx, python, site_dirs_of(python))
        log(f"  up to date (stamp matches); {fmt_s(time.monotonic() - t0)}")
        return 0

    if python.exists() and not version_ok:
        log(f"  python changed ({venv_version(shared)} -> {running_version()}): recreating")
    if not python.exists() or not version_ok:
        log("  creating the venv")
        create_venv(shared, with_pip=True)
    stamp_file.unlink(missing_ok=True)
    sites = site_dirs_of(python)

    # 1. torch first, so nothing below can pull a different (e.g. multi-GB CUDA) build.
    have = installed_dists(sites)
    if gpu and "torch" in have and not os.environ.get("KERNELBAY_TORCH"):
        log(f"  keeping the installed torch {have['torch']} (GPU machine)")
    else:
        argv = [*pip_args(python), torch_req]
        if torch_index:
            argv += ["--extra-index-url", torch_index]
        log(f"  $ {shlex.join(argv)}")
        if run_cmd(argv, cwd=ctx.root).returncode != 0:
            raise die(f"installing {torch_req} failed", 1)
    torch_version = installed_dists(sites).get("torch")
    if torch_version is None:
        raise die("torch is not installed in the shared env after installing it", 1)

    # 2. everything else, with torch held at the version just installed.
    with tempfile.TemporaryDirectory() as tmp:
        constraints = Path(tmp) / "torch-constraint.txt"
        public = torch_version.split("+", 1)[0]
        constraints.write_text(f"torch=={public}\n", encoding="utf-8")
        argv = [*pip_args(python), "-r", str(req_file), "-c", str(constraints)]
        log(f"  $ {shlex.join(argv)}")
        if run_cmd(argv, cwd=ctx.root).returncode != 0:
            raise die("installing scripts/requirements-shared.txt failed", 1)

    remove_our_packages(ctx, python, sites)
    check = run_cmd(
        [
            python,
            "-c",
            "import torch, pluggy, pydantic, safetensors, tqdm, numpy, pytest; "
            "print('  torch', torch.__version__, 'cuda' if torch.cuda.is_available() else 'cpu')",
        ],
        cwd=ctx.root,
    )
    if check.returncode != 0:
        raise die("the shared env does not import its packages", 1)
    stamp_file.write_text(stamp + "\n", encoding="utf-8")
    log(f"  shared env ready in {fmt_s(time.monotonic() - t0)}")
    return 0


def shared_sites_or_die(ctx: Context) -> list[Path]:
    python = venv_python(ctx.shared)
    if not (python.exists() and (ctx.shared / STAMP_NAME).is_file()):
        raise die(f"no shared env at {ctx.shared}: run `python3 scripts/ci.py setup` first")
    if venv_version(ctx.shared) != running_version():
        raise die(
            f"the shared env was made with Python {venv_version(ctx.shared)}, this is "
            f"{running_version()}: run `python3 scripts/ci.py setup` with this python"
        )
    sites = site_dirs_of(python)
    ours = ctx.our_names()
    leaked = sorted(n for n in installed_dists(sites) if is_ours(n, ours))
    if leaked:
        raise die(
            f"our own packages {leaked} are installed in the shared env {ctx.shared}; "
            "run `python3 scripts/ci.py setup` to remove them"
        )
    return sites


# --------------------------------------------------------------------------------------------
# Job venvs


@dataclasses.dataclass
class Phase:
    label: str
    status: str
    seconds: float
    detail: str = ""


@dataclasses.dataclass
class JobResult:
    job: Job
    status: str = PASS
    venv_s: float = 0.0
    install_s: float | None = None
    check_s: float = 0.0
    total_s: float = 0.0
    phases: list[Phase] = dataclasses.field(default_factory=list)

    def fail(self, status: str = FAIL) -> None:
        if self.status == PASS:
            self.status = status
        elif self.status == NO_TESTS and status == FAIL:
            self.status = FAIL


def make_job_venv(ctx: Context, name: str, shared_sites: Sequence[Path]) -> Path:
    """A fresh venv at <venvs>/<name> that sees the shared env's packages (pip included)."""
    if name == SHARED_NAME:
        raise die(f"a job may not be called {SHARED_NAME!r}")
    vdir = ctx.venvs / name
    create_venv(vdir, with_pip=False)
    for site in site_dirs_of(venv_python(vdir)):
        write_pth(site, shared_sites)
        break  # purelib is enough: site.addsitedir adds every shared dir
    return vdir


def install_packages(
    ctx: Context, vdir: Path, packages: Sequence[str], env: Mapping[str, str]
) -> tuple[bool, str]:
    """Build and install our package dirs as real wheels into a job venv, offline.

    Returns (ok, message). Third-party requirements must be satisfied by the shared env
    (seen through the .pth): pip runs with --no-index and no config, and afterwards the job
    venv must hold nothing but our own distributions.
    """
    python = venv_python(vdir)
    specs: list[str] = []
    expected: set[str] = set()
    for pkg in packages:
        pdir = ctx.root / pkg
        if not (pdir / "pyproject.toml").is_file():
            return False, f"{pkg}/pyproject.toml is missing"
        meta = read_project(pdir)
        expected.add(normalize(meta.name))
        specs.append(f"{pdir}[test]" if "test" in meta.extras else str(pdir))
    argv = [
        str(python), "-m", "pip", "install", "--no-build-isolation", "--check-build-dependencies",
        "--no-index", "--no-input", "--progress-bar", "off", *specs,
    ]  # fmt: skip
    done = run_cmd(
        argv, cwd=ctx.root, env=offline_pip_env(env), capture=True, timeout=job_timeout()
    )
    out = done.stdout or ""
    if done.returncode != 0:
        log(out.rstrip())
        hint = (
            "a third-party dependency (runtime, [test] extra or build backend) is missing from "
            "the shared env: add it to scripts/requirements-shared.txt and rerun setup"
            if re.search(r"No matching distribution|Could not find a version|Missing build", out)
            else "the package failed to build or install (see pip's output above)"
        )
        return False, f"pip install failed: {hint}"
    if re.search(r"^\s*(Downloading|Obtaining) ", out, re.MULTILINE):
        log(out.rstrip())
        return False, "pip downloaded something although it ran offline"
    job_sites = site_dirs_of(python)
    dists = installed_dists(job_sites)
    ours = ctx.our_names() | expected
    foreign = sorted(f"{n}=={v}" for n, v in dists.items() if not is_ours(n, ours))
    if foreign:
        log(out.rstrip())
        return False, (
            f"pip installed third-party packages into the job venv instead of using the shared "
            f"env: {foreign}; add them to scripts/requirements-shared.txt"
        )
    missing = sorted(expected - set(dists))
    if missing:
        log(out.rstrip())
        return False, f"not installed in the job venv: {missing}"
    versions = ", ".join(f"{n}=={dists[n]}" for n in sorted(expected))
    satisfied = sorted(
        set(re.findall(r"^Requirement already satisfied: ([A-Za-z0-9_.\-]+)", out, re.MULTILINE))
    )
    torch = f" (torch {_shared_version(out, 'torch')})" if "torch" in satisfied else ""
    return True, (
        f"built and installed {versions}; offline, {len(satisfied)} third-party requirements "
        f"already satisfied by the shared env{torch}"
    )


def _shared_version(pip_output: str, name: str) -> str:
    found = re.search(rf"^Requirement already satisfied: {name}\b.*\(([^()]+)\)$", pip_output, re.M)
    return found.group(1) if found else "?"


def pytest_status(returncode: int, path_exists: bool) -> tuple[str, str]:
    """(status, detail) of one pytest run. No tests is a failure: every package needs tests."""
    if not path_exists:
        return NO_TESTS, "test path does not exist"
    if returncode == 0:
        return PASS, ""
    if returncode == 5:
        return FAIL, "no tests collected (pytest exit 5)"
    if returncode == TIMEOUT_RC:
        return FAIL, "timed out (KERNELBAY_CI_TIMEOUT)"
    return FAIL, f"pytest exit {returncode}"


def display(cmd: Sequence[str]) -> str:
    return shlex.join("python" if part == PY else part for part in cmd)


def substitute(cmd: Sequence[str], python: Path) -> list[str]:
    return [str(python) if part == PY else part for part in cmd]


def run_job(
    ctx: Context,
    job: Job,
    shared_sites: Sequence[Path],
    pytest_args: Sequence[str],
    index: int,
    total: int,
) -> JobResult:
    res = JobResult(job)
    t0 = time.monotonic()
    bar = "=" * 92
    log(f"\n{bar}\n[{index}/{total}] job {job.name}: {job.description}")
    if job.packages:
        log(f"  install: {' '.join(job.packages)}")
    if job.tests:
        log(f"  tests:   {' '.join(job.tests)}")
    log(bar)

    vdir = make_job_venv(ctx, job.name, shared_sites)
    python = venv_python(vdir)
    env = clean_env(vdir, ctx)
    res.venv_s = time.monotonic() - t0
    log(f"-- fresh venv {rel(vdir, ctx.root)} (+ {PTH_NAME}) in {fmt_s(res.venv_s)}")

    if job.packages:
        t1 = time.monotonic()
        ok, msg = install_packages(ctx, vdir, job.packages, env)
        res.install_s = time.monotonic() - t1
        log(f"-- install ({fmt_s(res.install_s)}): {msg}")
        res.phases.append(Phase("install", PASS if ok else FAIL, res.install_s, msg))
        if not ok:
            res.fail()
            res.total_s = time.monotonic() - t0
            return res

    t2 = time.monotonic()
    for cmd in job.commands:
        argv = substitute(cmd, python)
        label = display(cmd)
        log(f"-- $ {label}")
        t = time.monotonic()
        rc = run_cmd(argv, cwd=ctx.root, env=env, timeout=job_timeout()).returncode
        status = PASS if rc == 0 else FAIL
        detail = "" if rc == 0 else "timed out" if rc == TIMEOUT_RC else f"exit {rc}"
        res.phases.append(Phase(label, status, time.monotonic() - t, detail))
        if rc != 0:
            res.fail()
    for path in job.tests:
        exists = (ctx.root / path).exists()
        t = time.monotonic()
        rc = -1
        if exists:
            argv = [str(python), "-m", "pytest", "-p", "no:cacheprovider", path, *pytest_args]
            log(f"-- $ python -m pytest -p no:cacheprovider {shlex.join([path, *pytest_args])}")
            rc = run_cmd(argv, cwd=ctx.root, env=env, timeout=job_timeout()).returncode
        status, detail = pytest_status(rc, exists)
        if not exists:
            log(f"-- {path}: {NO_TESTS} ({detail}); every package must have tests")
        res.phases.append(Phase(f"pytest {path}", status, time.monotonic() - t, detail))
        if status != PASS:
            res.fail(status)
    res.check_s = time.monotonic() - t2
    res.total_s = time.monotonic() - t0
    log(f"-- job {job.name}: {res.status} in {fmt_s(res.total_s)}")
    return res


def summary_table(results: Sequence[JobResult]) -> str:
    head = ("job", "result", "venv", "install", "checks", "total")
    rows = [
        (r.job.name, r.status, fmt_s(r.venv_s), fmt_s(r.install_s), fmt_s(r.check_s),
         fmt_s(r.total_s))
        for r in results
    ]  # fmt: skip
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=True)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(head, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for r, row in zip(results, rows, strict=True):
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        for ph in r.phases:
            if ph.status != PASS:
                lines.append(
                    f"    {ph.status}: {ph.label}" + (f" ({ph.detail})" if ph.detail else "")
                )
    return "\n".join(lines)


def cmd_run(
    ctx: Context, names: Sequence[str], use_all: bool, fail_fast: bool, pytest_args: Sequence[str]
) -> int:
    if not names and not use_all:
        raise die("give job names or --all (see `python3 scripts/ci.py jobs`)")
    jobs = select_jobs(build_jobs(ctx.root), names, use_all, os.environ.get("KERNELBAY_CI_JOBS"))
    if not jobs:
        raise die("no job selected (check KERNELBAY_CI_JOBS)")
    shared_sites = shared_sites_or_die(ctx)
    t0 = time.monotonic()
    results: list[JobResult] = []
    for i, job in enumerate(jobs, 1):
        results.append(run_job(ctx, job, shared_sites, pytest_args, i, len(jobs)))
        if fail_fast and results[-1].status != PASS:
            log(f"\n--fail-fast: stopping after {job.name}")
            break
    failed = [r for r in results if r.status != PASS]
    log("\n" + "=" * 92)
    log(f"summary ({len(results)} job(s), {fmt_s(time.monotonic() - t0)} wall)")
    log(summary_table(results))
    if failed:
        log(f"\n{len(failed)} job(s) failed: {', '.join(r.job.name for r in failed)}")
        return 1
    log("\nall jobs passed")
    return 0


# --------------------------------------------------------------------------------------------
# demo

def cmd_demo(ctx: Context) -> int:
    cmd_setup(ctx)
    shared_sites = shared_sites_or_die(ctx)
    packages = ["core", *(d.relative_to(ctx.root).as_posix() for d in plugin_dirs(ctx.root))]
    log(f"== demo venv: {' '.join(packages)}")
    vdir = make_job_venv(ctx, "demo", shared_sites)
    env = clean_env(vdir, ctx)
    ok, msg = install_packages(ctx, vdir, packages, env)
    log(f"  {msg}")
    if not ok:
        return 1
    exe = str(venv_bin(vdir) / "kernelbay")
    log("\n$ kernelbay run   (the bundled demo model on the best backends here)")
    rc = run_cmd([exe, "run"], cwd=ctx.root, env=env).returncode
    if rc != 0:
        log(f"exit {rc}")
        return rc
    log(f"\ndemo venv: {vdir} (try {vdir / 'bin' / 'kernelbay'} --help)")
    return rc


# --------------------------------------------------------------------------------------------
# GitHub Actions


def _yaml_str(s: str) -> str:
    return json.dumps(s)  # a JSON string is a valid YAML double-quoted scalar


def gha_workflow(jobs: Sequence[Job]) -> str:
    lines = [
        "# Generated by `python3 scripts/ci.py gha --write` from the job matrix",
        "# (`python3 scripts/ci.py jobs`). Do not edit by hand; tests/test_matrix_script.py",
        "# fails when this file and the generator disagree.",
        "name: CI",
        "",
        "on:",
        "  push:",
        "    branches: [main]",
        "  pull_request:",
        "  workflow_dispatch:",
        "",
        "permissions:",
        "  contents: read",
        "",
        "concurrency:",
        "  group: ci-${{ github.ref }}",
        "  cancel-in-progress: true",
        "",
        "env:",
        "  # GitHub runners have no GPU: take the CPU build of the pinned torch.",
        f"  KERNELBAY_TORCH_INDEX: {_yaml_str('https://download.pytorch.org/whl/cpu')}",
        '  PIP_DISABLE_PIP_VERSION_CHECK: "1"',
        '  PYTHONUNBUFFERED: "1"',
        "",
        "jobs:",
    ]
    for job in jobs:
        lines += [
            f"  {job.name}:",
            f"    name: {job.name}",
            "    runs-on: ubuntu-latest",
            "    timeout-minutes: 60",
            "    steps:",
            "      - uses: actions/checkout@v4",
            "      - uses: actions/setup-python@v5",
            "        with:",
            '          python-version: "3.11"',
            "          cache: pip",
            f"          cache-dependency-path: {REQUIREMENTS.as_posix()}",
            f"      - name: {_yaml_str('setup + run ' + job.name)}",
            f"        run: python3 scripts/ci.py setup && python3 scripts/ci.py run {job.name}",
        ]
    return "\n".join(lines) + "\n"


def cmd_gha(ctx: Context, write: bool, check: bool) -> int:
    text = gha_workflow(build_jobs(ctx.root))
    target = ctx.root / WORKFLOW
    if check:
        current = target.read_text(encoding="utf-8") if target.is_file() else ""
        if current != text:
            log(f"{rel(target, ctx.root)} is out of date: run `python3 scripts/ci.py gha --write`")
            return 1
        log(f"{rel(target, ctx.root)} is up to date")
        return 0
    if write:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
        log(f"wrote {rel(target, ctx.root)}")
        return 0
    sys.stdout.write(text)
    return 0


# --------------------------------------------------------------------------------------------
# jobs


def cmd_jobs(ctx: Context, as_json: bool) -> int:
    jobs = build_jobs(ctx.root)
    if as_json:
        print(json.dumps([j.to_json() for j in jobs], indent=2))
        return 0
    width = max(len(j.name) for j in jobs)
    for j in jobs:
        print(f"{j.name.ljust(width)}  {j.description}")
        if j.packages:
            print(f"{'':{width}}    install: {' '.join(j.packages)}")
        if j.tests:
            print(f"{'':{width}}    tests:   {' '.join(j.tests)}")
        for c in j.commands:
            print(f"{'':{width}}    run:     {display(c)}")
    return 0


# --------------------------------------------------------------------------------------------
# main


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    argv = list(argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(prog="scripts/ci.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--root", type=Path, default=REPO_ROOT, help=argparse.SUPPRESS)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    s = sub.add_parser("setup", help="create/update the shared third-party venv")
    s.add_argument("--force", action="store_true", help="reinstall even if the stamp matches")
    s = sub.add_parser("jobs", help="print the job matrix")
    s.add_argument("--json", action="store_true")
    s = sub.add_parser("run", help="run jobs in fresh venvs (extra pytest args after --)")
    s.add_argument("jobs", nargs="*", metavar="JOB")
    s.add_argument("--all", action="store_true", help="every job ($KERNELBAY_CI_JOBS filters)")
    s.add_argument("--fail-fast", action="store_true", help="stop at the first failed job")
    sub.add_parser("demo", help="set up a demo venv and run the kernelbay CLI")
    s = sub.add_parser("gha", help="print the GitHub Actions workflow")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--write", action="store_true", help=f"write {WORKFLOW.as_posix()}")
    g.add_argument("--check", action="store_true", help="exit 1 if the file is out of date")
    args = p.parse_args(argv)
    if extra and args.command != "run":
        p.error("arguments after -- are only for `run` (passed to pytest)")
    return args, extra


def main(argv: Sequence[str] | None = None) -> int:
    args, extra = parse_args(sys.argv[1:] if argv is None else argv)
    ctx = Context.create(args.root)
    try:
        if args.command == "setup":
            return cmd_setup(ctx, force=args.force)
        if args.command == "jobs":
            return cmd_jobs(ctx, args.json)
        if args.command == "run":
            return cmd_run(ctx, args.jobs, args.all, args.fail_fast, extra)
        if args.command == "demo":
            return cmd_demo(ctx)
        if args.command == "gha":
            return cmd_gha(ctx, args.write, args.check)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `ci.py jobs | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
