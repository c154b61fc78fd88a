"""scripts/ci.py: the job matrix, the generated workflow and the shared-env plumbing.

Fast and offline: no venv is created, nothing is installed, nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load_ci() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kernelbay_ci_script", ROOT / "scripts" / "ci.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being created
    spec.loader.exec_module(module)
    return module


ci = _load_ci()


def _write(path: Path, text: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def _pyproject(pkg_dir: Path, name: str, extras: str = "") -> None:
    _write(
        pkg_dir / "pyproject.toml",
        f"""\
        [build-system]
        requires = ["hatchling>=1.21"]
        build-backend = "hatchling.build"

        [project]
        name = "{name}"
        version = "0.1.0"
        dependencies = ["kernelbay>=0.1,<1"]
        {extras}
        """,
    )


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A minimal repo: core, plugins a and b, a plugin-less folder, the vendor example."""
    _pyproject(tmp_path / "core", "kernelbay")
    _pyproject(tmp_path / "plugins" / "b_two", "kernelbay-b-two")
    _pyproject(tmp_path / "plugins" / "a_one", "kernelbay-a-one")
    (tmp_path / "plugins" / "notes").mkdir()  # no pyproject.toml: not a package
    _pyproject(tmp_path / "examples" / "vendor_plugin", "acme-kernelbay")
    return tmp_path


# --- the real repository ---------------------------------------------------------------------


def test_committed_workflow_is_what_the_generator_writes() -> None:
    committed = ROOT / ".github" / "workflows" / "ci.yml"
    assert committed.is_file(), "run `python3 scripts/ci.py gha --write` (or `make gha`)"
    expected = ci.gha_workflow(ci.build_jobs(ROOT))
    assert committed.read_text(encoding="utf-8") == expected, (
        ".github/workflows/ci.yml is out of date: run `python3 scripts/ci.py gha --write`"
    )


def test_one_plugin_job_per_plugin_directory() -> None:
    plugins = ROOT / "plugins"
    dirs = sorted(
        d.name
        for d in (plugins.iterdir() if plugins.is_dir() else [])
        if d.is_dir() and not d.name.startswith((".", "_"))
    )
    jobs = {job.name: job for job in ci.build_jobs(ROOT)}
    assert sorted(n for n in jobs if n.startswith("plugin-")) == [f"plugin-{d}" for d in dirs], (
        "every plugins/<name>/ needs a pyproject.toml (and gets a job)"
    )
    for d in dirs:
        job = jobs[f"plugin-{d}"]
        assert job.packages == ("core", f"plugins/{d}")
        assert job.tests == (f"plugins/{d}/tests",)
    assert set(jobs["all"].packages) == {"core", "examples/vendor_plugin"} | {
        f"plugins/{d}" for d in dirs
    }


def test_shared_requirements_hold_no_package_of_ours_and_no_torch() -> None:
    lines = [
        line.split("#", 1)[0].strip()
        for line in (ROOT / "scripts" / "requirements-shared.txt").read_text(encoding="utf-8").splitlines()
    ]
    names = [ci.normalize(re.split(r"[\s;<>=!~\[]", line, maxsplit=1)[0]) for line in lines if line]
    assert not [n for n in names if n == "kernelbay" or n.startswith("kernelbay-")]
    assert "torch" not in names, "torch is installed first, by `setup`, not from the file"
    for needed in ("pluggy", "pydantic", "safetensors", "pytest", "hatchling", "transformers"):
        assert needed in names
    triton = next(line for line in lines if line.startswith("triton"))
    assert 'sys_platform == "linux"' in triton and 'platform_machine == "x86_64"' in triton


def test_entry_points_all_run_the_same_commands() -> None:
    assert re.search(r"^\s*make test\s*$", (ROOT / ".ci" / "run").read_text(encoding="utf-8"), re.MULTILINE)
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert "$(CI) setup && $(CI) run --all" in makefile
    assert re.search(r"^demo:\n\t\$\(CI\) demo$", makefile, re.MULTILINE)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "make demo" in readme and "make test" in readme


# --- the matrix on a temporary tree ----------------------------------------------------------


def test_lint_types_every_package_with_sources(tree: Path) -> None:
    """mypy in the lint job covers the core, every plugin and the vendor example that have a
    src folder, found on the file system (a new plugin is typed without editing the CI)."""
    for package in ("core", "plugins/b_two", "examples/vendor_plugin"):
        (tree / package / "src").mkdir(parents=True)
    lint = ci.build_jobs(tree)[0]
    mypy = next(c for c in lint.commands if "mypy" in c)
    assert mypy[mypy.index("mypy") + 1:] == ("core/src", "plugins/b_two/src",
                                             "examples/vendor_plugin/src")


def test_matrix_from_the_file_system(tree: Path) -> None:
    jobs = ci.build_jobs(tree)
    assert [j.name for j in jobs] == [
        "lint",
        "core",
        "plugin-a_one",
        "plugin-b_two",
        "vendor-example",
        "all",
    ]
    by = {j.name: j for j in jobs}
    assert by["lint"].packages == () and by["lint"].commands
    assert by["core"].packages == ("core",) and by["core"].tests == ("core/tests",)
    assert by["plugin-a_one"].packages == ("core", "plugins/a_one")
    assert by["vendor-example"].tests == ("examples/vendor_plugin/tests",)
    assert by["all"].packages == (
        "core",
        "plugins/a_one",
        "plugins/b_two",
        "examples/vendor_plugin",
    )
    assert by["all"].tests == (
        "tests",
        "core/tests",
        "plugins/a_one/tests",
        "plugins/b_two/tests",
        "examples/vendor_plugin/tests",
    )


def test_bench_joins_the_all_job_only_when_it_has_tests(tree: Path) -> None:
    _write(tree / "bench" / "run_bench.py", "print('bench')\n")
    assert "bench" not in ci.build_jobs(tree)[-1].tests
    _write(tree / "bench" / "test_bench_smoke.py", "def test_smoke(): pass\n")
    assert ci.build_jobs(tree)[-1].tests[-1] == "bench"


def test_jobs_json_command(tree: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "ci.py"), "--root", str(tree), "jobs", "--json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    data = json.loads(out)
    assert [j["name"] for j in data][:3] == ["lint", "core", "plugin-a_one"]
    assert data[0]["commands"][0] == ["{python}", "-m", "ruff", "check", "."]


def test_select_jobs_and_the_env_filter(tree: Path) -> None:
    jobs = ci.build_jobs(tree)
    assert [j.name for j in ci.select_jobs(jobs, [], True, None)] == [j.name for j in jobs]
    picked = ci.select_jobs(jobs, [], True, "all, core")
    assert [j.name for j in picked] == ["core", "all"]  # matrix order, not the filter's
    assert [j.name for j in ci.select_jobs(jobs, ["all", "lint"], False, None)] == ["all", "lint"]
    with pytest.raises(SystemExit):
        ci.select_jobs(jobs, ["nope"], False, None)
    with pytest.raises(SystemExit):
        ci.select_jobs(jobs, [], True, "core,nope")


def test_workflow_has_one_job_per_matrix_entry(tree: Path) -> None:
    jobs = ci.build_jobs(tree)
    text = ci.gha_workflow(jobs)
    body = text.split("\njobs:\n", 1)[1]
    assert re.findall(r"^  (\S+):$", body, re.MULTILINE) == [j.name for j in jobs]
    for job in jobs:
        step = f"python3 scripts/ci.py setup && python3 scripts/ci.py run {job.name}"
        assert f"run: {step}\n" in text
    assert text.count("cache: pip") == len(jobs)


# --- shared env plumbing ---------------------------------------------------------------------


def test_pth_makes_the_shared_site_visible_after_the_job_site(tmp_path: Path) -> None:
    shared, extra, job = tmp_path / "shared site", tmp_path / "extra", tmp_path / "job"
    _write(shared / "kb_probe_shared.py", "WHERE = 'shared'\n")
    _write(shared / "nested.pth", f"{extra}\n")  # the shared env's own .pth files count too
    _write(extra / "kb_probe_extra.py", "WHERE = 'extra'\n")
    _write(job / "kb_probe_shared.py", "WHERE = 'job'\n")  # our fresh install must win
    pth = ci.write_pth(job, [shared])
    assert pth.name == ci.PTH_NAME
    code = (
        "import site, sys; site.addsitedir(sys.argv[1]);"
        "import kb_probe_shared, kb_probe_extra;"
        "print(kb_probe_shared.WHERE, kb_probe_extra.WHERE)"
    )
    out = subprocess.run(
        [sys.executable, "-I", "-S", "-c", code, str(job)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out == ["job", "extra"]


def test_installed_dists_and_ownership(tmp_path: Path) -> None:
    _write(
        tmp_path / "torch-2.13.0+cpu.dist-info" / "METADATA", "Name: torch\nVersion: 2.13.0+cpu\n"
    )
    _write(tmp_path / "kernelbay_x-0.1.dist-info" / "METADATA", "Name: kernelbay_x\nVersion: 0.1\n")
    (tmp_path / "Odd_Name-1.0.dist-info").mkdir()
    found = ci.installed_dists([tmp_path, tmp_path / "missing"])
    assert found == {"torch": "2.13.0+cpu", "kernelbay-x": "0.1", "odd-name": "1.0"}
    assert ci.is_ours("kernelbay_x", set()) and ci.is_ours("Acme.Plugin", {"acme-plugin"})
    assert not ci.is_ours("torch", {"acme-plugin"})


def test_our_names_come_from_every_pyproject(tree: Path) -> None:
    ctx = ci.Context(root=tree, venvs=tree / ".venvs")
    assert ctx.our_names() == {"kernelbay", "kernelbay-a-one", "kernelbay-b-two", "acme-kernelbay"}
    assert ctx.shared == tree / ".venvs" / "_shared"


def test_venvs_dir_is_overridable(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KERNELBAY_VENVS", str(tree / "elsewhere"))
    assert ci.Context.create(tree).shared == (tree / "elsewhere" / "_shared").resolve()
    monkeypatch.delenv("KERNELBAY_VENVS")
    assert ci.Context.create(tree).venvs == (tree / ".venvs").resolve()


def test_project_reading_with_and_without_tomllib(tree: Path) -> None:
    _pyproject(tree / "p", "Kernelbay_P", '[project.optional-dependencies]\ntest = ["hypothesis"]')
    meta = ci.read_project(tree / "p")
    assert meta.name == "Kernelbay_P" and meta.extras == frozenset({"test"})
    text = (tree / "p" / "pyproject.toml").read_text(encoding="utf-8")
    assert ci._parse_toml_minimal(text) == ("Kernelbay_P", {"test"})


def test_torch_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KERNELBAY_TORCH", raising=False)
    assert ci.torch_requirement(gpu=False) == "torch==2.13.0"
    assert ci.torch_requirement(gpu=True) == "torch>=2.6"
    monkeypatch.setenv("KERNELBAY_TORCH", "torch==2.7.1")
    assert ci.torch_requirement(gpu=False) == "torch==2.7.1"
    monkeypatch.setenv("KERNELBAY_GPU", "0")
    assert ci.detect_gpu() is False
    monkeypatch.setenv("KERNELBAY_GPU", "1")
    assert ci.detect_gpu() is True


def test_setup_stamp_tracks_requirements_and_torch_choice() -> None:
    base = ci.setup_stamp(b"pluggy>=1.5\n", "gpu=False torch==2.13.0", "")
    assert base == ci.setup_stamp(b"pluggy>=1.5\n", "gpu=False torch==2.13.0", "")
    assert base != ci.setup_stamp(b"pluggy>=1.6\n", "gpu=False torch==2.13.0", "")
    assert base != ci.setup_stamp(b"pluggy>=1.5\n", "gpu=True torch>=2.6", "")
    assert base != ci.setup_stamp(b"pluggy>=1.5\n", "gpu=False torch==2.13.0", "https://x")


def test_job_env_drops_the_callers_kernelbay_policy(
    tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KERNELBAY_DEVICE", "sm_100")
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    monkeypatch.setenv("PIP_INDEX_URL", "https://example.invalid/simple")
    ctx = ci.Context(root=tree, venvs=tree / ".venvs")
    env = ci.clean_env(tree / ".venvs" / "core", ctx)
    assert "KERNELBAY_DEVICE" not in env and "PYTHONPATH" not in env
    assert env["KERNELBAY_CI_SHARED_VENV"] == str(ctx.shared)
    assert env["PATH"].startswith(str(tree / ".venvs" / "core"))
    pip_env = ci.offline_pip_env(env)
    assert "PIP_INDEX_URL" not in pip_env and pip_env["PIP_CONFIG_FILE"]


@pytest.mark.parametrize(
    ("rc", "exists", "status"),
    [(0, True, "pass"), (1, True, "FAIL"), (5, True, "FAIL"), (-1, False, "no tests")],
)
def test_pytest_outcomes(rc: int, exists: bool, status: str) -> None:
    got, detail = ci.pytest_status(rc, exists)
    assert got == status
    if rc == 5:
        assert "no tests collected" in detail


def test_fallback_toml_reader_agrees_with_tomllib_on_the_repo() -> None:
    tomllib = pytest.importorskip("tomllib")
    pyprojects = [ROOT / "core" / "pyproject.toml", *ROOT.glob("plugins/*/pyproject.toml")]
    pyprojects += ROOT.glob("examples/*/pyproject.toml")
    for path in pyprojects:
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8")
        project = tomllib.loads(text)["project"]
        name, extras = ci._parse_toml_minimal(text)
        assert name == project["name"], path
        assert extras == set(project.get("optional-dependencies", {})), path


def test_a_command_that_runs_too_long_is_killed(tmp_path: Path) -> None:
    sleeper = "[sys.executable, '-c', 'import time; time.sleep(60)']"
    code = f"import subprocess, sys, time; subprocess.Popen({sleeper}); time.sleep(60)"
    done = ci.run_cmd([sys.executable, "-c", code], cwd=tmp_path, capture=True, timeout=0.5)
    assert done.returncode == ci.TIMEOUT_RC
    assert ci.pytest_status(ci.TIMEOUT_RC, True)[0] == "FAIL"
