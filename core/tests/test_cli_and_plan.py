"""The CLI (plugins, doctor, explain) and the per-layer plan."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from kernelbay import BackendKind, Policy, Registry, parse_device
from kernelbay.cli import main
from kernelbay.layers import LinearModule
from kernelbay.plan import plan_checkpoint, shard_linear
from kernelbay.requests import UNQUANTIZED
from kernelbay.testing.checkpoints import write_tiny_llama

FAKES = os.path.join(os.path.dirname(__file__), "fakeplugins")


def _fake_distribution(root: str, name: str, entry_points: dict[str, str]) -> None:
    """A real installed-looking distribution (dist-info) that importlib.metadata discovers."""
    info = os.path.join(root, f"{name}-0.0.1.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.0.1\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write("[kernelbay.plugins]\n")
        f.writelines(f"{k} = {v}\n" for k, v in entry_points.items())


def _run_cli(args: list[str], extra_path: str, env: dict[str, str] | None = None
             ) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KERNELBAY_")}
    environ["PYTHONPATH"] = os.pathsep.join([extra_path, FAKES, environ.get("PYTHONPATH", "")])
    environ.update(env or {})
    return subprocess.run([sys.executable, "-m", "kernelbay.cli", *args], capture_output=True,
                          text=True, env=environ, check=False, timeout=120)


def test_plugins_json_lists_real_installed_faults(tmp_path: object) -> None:
    root = str(tmp_path)
    _fake_distribution(root, "kb-fakes", {"good": "kb_fake_good", "boom": "kb_fake_import_error",
                                          "old": "kb_fake_old_api"})
    done = _run_cli(["plugins", "--json"], root)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    status = {p["name"]: p["status"] for p in report["plugins"]}
    assert status["core"] == "loaded" and status["good"] == "loaded"
    assert status["boom"] == "failed" and status["old"] == "incompatible"
    good = next(p for p in report["plugins"] if p["name"] == "good")
    assert good["distribution"] == "kb-fakes" and good["offers"] == {"linear": ["fake-fp32-only"]}
    strict = _run_cli(["plugins"], root, {"KERNELBAY_STRICT": "1"})
    assert strict.returncode == 2 and "fake plugin exploded" in strict.stderr


@pytest.fixture(autouse=True)
def core_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI reads the environment: keep installed plugins out of these core tests."""
    monkeypatch.setenv("KERNELBAY_PLUGINS", "")


def test_plugins_text_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "plugin" in out.splitlines()[1] and "core" in out


def test_quantize_list_without_writers_says_what_to_install(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["quantize", "--list"]) == 0
    assert "pip install kernelbay-quant-nvfp4" in capsys.readouterr().out


def test_quantize_without_its_arguments_names_the_missing_ones(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["quantize", "some/model"])
    assert exc.value.code == 2
    assert "required: destination, --format (or --list)" in capsys.readouterr().err


def test_doctor_reports_the_device(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--json", "--device", "sm_90"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["device"]["arch"] == "sm_90"
    assert any(b["backend"] == "torch-unquantized" for b in report["backends"])


def test_explain_plans_every_layer(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_tiny_llama(os.path.join(str(tmp_path), "m"))
    assert main(["explain", path, "--json", "--device", "sm_90", "--tp", "2"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["ok"] and plan["tp_size"] == 2
    assert plan["format"]["chosen"] == "unquantized"
    assert plan["collective"]["chosen"] == "torch-distributed"
    modules = {d["module"]: d for d in plan["linears"]}
    assert len(modules) == 2 * 7 + 1
    assert "K=64 -> N=32" in modules["model.layers.0.self_attn.q_proj"]["request"]
    assert "K=32 -> N=64" in modules["model.layers.1.self_attn.o_proj"]["request"]
    assert main(["explain", path]) == 0
    text = capsys.readouterr().out
    assert "model.layers.*.mlp.down_proj" in text and "torch-unquantized" in text


def test_explain_reports_a_layer_without_backend(tmp_path: object) -> None:
    path = write_tiny_llama(os.path.join(str(tmp_path), "m"))
    registry = Registry(Policy(disable=frozenset({"torch-unquantized"})))
    plan = plan_checkpoint(path, registry=registry, device=parse_device("cpu"))
    assert not plan.ok
    assert all(d.selection is None for d in plan.linears)
    assert "KERNELBAY_DISABLE" in plan.linears[0].error


def test_explain_bad_input_is_one_clear_error(tmp_path: object,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", os.path.join(str(tmp_path), "nothing")]) == 2
    assert "not a checkpoint folder" in capsys.readouterr().err
    assert main(["explain", str(tmp_path), "--device", "sm_9x"]) == 2


def test_tp_sharding_splits_by_role() -> None:
    q = LinearModule("model.layers.0.self_attn.q_proj", 64, 128, False, "attn_qkv", "bfloat16")
    o = LinearModule("model.layers.0.self_attn.o_proj", 128, 64, False, "attn_out", "bfloat16")
    qa = LinearModule("model.layers.0.self_attn.q_a_proj", 64, 32, False, "attn_qkv", "bfloat16")
    assert shard_linear(q, UNQUANTIZED, "bfloat16", 1, 4).out_features == 32
    assert shard_linear(o, UNQUANTIZED, "bfloat16", 1, 4).in_features == 32
    assert shard_linear(qa, UNQUANTIZED, "bfloat16", 1, 4).parallel == "replicated"
    with pytest.raises(Exception, match="not divisible by tensor-parallel size 3"):
        shard_linear(q, UNQUANTIZED, "bfloat16", 0, 3)
    assert BackendKind.LINEAR.force_variable == "KERNELBAY_FORCE_LINEAR"
