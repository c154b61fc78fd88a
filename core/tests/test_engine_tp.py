"""Tensor parallel over gloo with two processes gives the same greedy tokens as one."""

from __future__ import annotations

import os

import pytest
from engine_helpers import greedy_tp2, save_tiny
from kernelbay import Policy, Registry
from kernelbay.engine import LLM, SamplingParams

PROMPTS = [[1, 17, 42, 99, 5], [1, 3, 3, 3, 3, 3, 8, 150]]


@pytest.mark.parametrize("family, extra", [("llama", {}), ("qwen2", {"vocab_size": 163})])
def test_tp2_gloo_matches_tp1(tmp_path: object, family: str, extra: dict[str, int]) -> None:
    path = save_tiny(os.path.join(str(tmp_path), family), family, **extra)
    single = LLM(path, device="cpu", dtype="float32", registry=Registry(Policy(plugins=frozenset())))
    expected = [o.token_ids for o in single.generate(
        PROMPTS, SamplingParams(max_tokens=16, ignore_eos=True))]
    results = greedy_tp2(path, PROMPTS, 16)
    assert results[0] == expected and results[1] == expected
