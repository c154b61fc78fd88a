"""The bundled demo model: transformers agrees with the engine, the card's held-out number is
reproduced, and the main command prints Python-looking code."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from kernelbay import Policy, Registry
from kernelbay.cli import main
from kernelbay.demo import BOS_ID, EOS_ID, VOCAB_SIZE, demo_path, heldout_text
from kernelbay.demo.evaluate import bits_per_byte
from kernelbay.engine import LLM

CORE_ONLY = Registry(Policy(plugins=frozenset()))


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(demo_path(), registry=CORE_ONLY)


def _card_bits_per_byte() -> float:
    with open(os.path.join(demo_path(), "README.md"), encoding="utf-8") as f:
        card = f.read()
    match = re.search(r"held-out bits per byte\*\* \| \*\*([0-9.]+)\*\*", card)
    assert match, "the model card must state the held-out bits per byte"
    return float(match.group(1))


def test_checkpoint_is_small_and_self_describing() -> None:
    files = set(os.listdir(demo_path()))
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json",
            "README.md", "heldout.txt"} <= files
    assert os.path.getsize(os.path.join(demo_path(), "model.safetensors")) <= 8 * 2**20
    assert len(heldout_text().encode()) <= 256 * 1024
    with open(os.path.join(demo_path(), "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert config["vocab_size"] == VOCAB_SIZE and config["eos_token_id"] == EOS_ID


def test_tokenizer_is_bytes_after_bos(llm: LLM) -> None:
    text = "déf f(x):\n\treturn x  # ✓"
    assert llm.encode(text) == [BOS_ID, *text.encode("utf-8")]
    assert llm.decode(list(text.encode("utf-8"))) == text


def test_transformers_gives_the_same_logits(llm: LLM) -> None:
    from transformers import AutoModelForCausalLM

    ids = llm.encode("class Stack:\n    def push(self, item):\n        self.items.append(")
    ours = LLM(demo_path(), device="cpu", dtype="float32", registry=CORE_ONLY).logits(ids)
    reference = AutoModelForCausalLM.from_pretrained(
        demo_path(), dtype=torch.float32, attn_implementation="eager",
        experts_implementation="eager").eval()
    with torch.no_grad():
        theirs = reference(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_heldout_bits_per_byte_matches_the_card(llm: LLM) -> None:
    stated = _card_bits_per_byte()
    measured = bits_per_byte(llm.logits, heldout_text())
    assert abs(measured - stated) <= 0.01 * stated, (measured, stated)


def test_main_command_prints_python(capsys: pytest.CaptureFixture[str],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KERNELBAY_PLUGINS", "")
    assert main(["run"]) == 0
    out = capsys.readouterr().out
    assert 'def read_config(path):\n    """' in out
    generated = out.split('"""', 1)[1]
    assert re.search(r"\b(return|self|def|import|if|for|class)\b", generated), generated
    assert "tokens/s" in out and "attention: torch-mla" in out


def test_heldout_windows_are_seeded_slices_of_the_sample() -> None:
    from kernelbay.demo import heldout_windows

    text = heldout_text()
    windows = heldout_windows(12, seed=5, shortest=40, spread=160)
    assert windows == heldout_windows(12, seed=5, shortest=40, spread=160)
    assert windows != heldout_windows(12, seed=6, shortest=40, spread=160)
    for w in windows:
        start = text.index(w)
        assert len(w) == 40 + start % 160 or text.count(w) > 1
