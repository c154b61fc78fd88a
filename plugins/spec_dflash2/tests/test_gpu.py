"""On CUDA: dflash2 speculation equals plain decoding (float32) and its top-k merge matches
the single-device candidates. Skipped without CUDA."""

from __future__ import annotations

import os

import pytest
import torch
from kernelbay.demo import demo_path, heldout_text
from kernelbay.engine import LLM, SamplingParams, SpeculativeConfig
from kernelbay_spec_dflash2.modules import topk_lower_id
from kernelbay_spec_dflash2.proposer import BUNDLED_DIR
from kernelbay_spec_dflash2.registry import dflash2_registry
from kernelbay_spec_dflash2.tp import vocab_parallel_topk

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not os.path.isfile(os.path.join(BUNDLED_DIR, "demo", "model.safetensors")),
                    reason="the demo drafter is not installed")
def test_cuda_speculation_equals_plain_decoding() -> None:
    registry = dflash2_registry()
    plain = LLM(demo_path(), device="cuda", dtype="float32", registry=registry,
                max_num_seqs=8)
    spec = LLM(demo_path(), device="cuda", dtype="float32", registry=registry, max_num_seqs=8,
               speculative=SpeculativeConfig("dflash2", 8))
    text = heldout_text()
    prompts = [plain.encode(text[s:s + 120]) for s in range(0, 8 * 5000, 5000)]
    for params in (SamplingParams(max_tokens=64, ignore_eos=True),
                   SamplingParams(max_tokens=64, temperature=0.8, seed=5, ignore_eos=True)):
        want = [o.token_ids for o in plain.generate(prompts, params)]
        got = spec.generate(prompts, params)
        assert [o.token_ids for o in got] == want
    assert sum(len(o.token_ids) for o in got) / sum(o.steps for o in got) > 1.5


def test_cuda_topk_pairs_match_the_whole_vocabulary() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randint(-3, 4, (64, 32000), device="cuda", generator=gen).float()
    values, ids = vocab_parallel_topk(logits, 16, 0, 32000, lambda x: x)
    want_values, want_ids = topk_lower_id(logits, 16)
    assert torch.equal(ids, want_ids) and torch.equal(values, want_values)
    # Two halves merged as two ranks would be: same answer.
    halves = [logits[:, :16000], logits[:, 16000:]]
    parts = [vocab_parallel_topk(h, 16, 16000 * r, 32000, lambda x: x) for r, h in
             enumerate(halves)]
    from kernelbay_spec_dflash2.tp import merge_topk

    merged = merge_topk(torch.cat([p[0] for p in parts], -1), torch.cat([p[1] for p in parts],
                                                                         -1), 16)
    assert torch.equal(merged[1], want_ids)
