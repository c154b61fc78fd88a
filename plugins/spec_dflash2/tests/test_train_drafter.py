"""tools/train_drafter.py: a tiny CPU run writes a loadable drafter, its card and its
record, and two runs with the same seed give identical weights."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from kernelbay_spec_dflash2.drafter import load_drafter

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "tools" / "train_drafter.py"


def _run(out: Path, corpus: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--device", "cpu",
                    "--steps", "2", "--batch", "4", "--prompts", "2", "--gen", "8",
                    "--prompt-len", "24", "--gen-batch", "2", "--eval-prompts", "1",
                    "--eval-tokens", "8", "--corpus", str(corpus)],
                   check=True, capture_output=True, timeout=600, env=env)


def test_tiny_cpu_run(tmp_path: Path) -> None:
    corpus = tmp_path / "stdlib"
    corpus.mkdir()
    for name in ("proposer.py", "speculative.py"):  # any Python source will do
        source = ROOT / "core" / "src" / "kernelbay" / ("layers" if name == "proposer.py"
                                                         else "engine") / name
        shutil.copy(source, corpus / name)
    _run(tmp_path / "a", corpus)
    _run(tmp_path / "b", corpus)
    drafter = load_drafter(str(tmp_path / "a"))
    assert drafter.config.target_model_type == "deepseek_v3"
    assert os.path.getsize(tmp_path / "a" / "model.safetensors") < 2_000_000
    stats = json.loads((tmp_path / "a" / "training.json").read_text(encoding="utf-8"))
    assert stats["steps"] == 2 and stats["tau_greedy"] >= 1.0
    assert "tau =" in (tmp_path / "a" / "README.md").read_text(encoding="utf-8")
    other = load_drafter(str(tmp_path / "b")).state_dict()
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(tensor, other[name]), name
