"""The engine in batch-invariant mode (core references, CPU): the mode reaches the norms,
the tied head and DeepSeek's own matmuls, keeps the model's numbers, and a request's tokens
do not depend on the rest of the batch."""

from __future__ import annotations

import torch
from kernelbay import Policy, Registry
from kernelbay.demo import demo_path
from kernelbay.engine import LLM, SamplingParams
from kernelbay.engine.models.deepseek_v3 import DeepseekV3Attention, DeepseekV3Router
from kernelbay.engine.modules import RMSNorm, VocabParallelEmbedding

PROMPTS = [[1, 17, 42, 99, 5], [1, 3, 3, 3, 3, 3, 8, 150], [7] * 12, [200, 201, 202]]


def test_mode_reaches_the_engine_and_keeps_the_numbers() -> None:
    invariant = LLM(demo_path(), dtype="float32",
                    registry=Registry(Policy(plugins=frozenset(), batch_invariant=True)))
    plain = LLM(demo_path(), dtype="float32", registry=Registry(Policy(plugins=frozenset())))
    flagged = [m.batch_invariant for m in invariant.model.modules()
               if isinstance(m, (RMSNorm, VocabParallelEmbedding, DeepseekV3Attention,
                                 DeepseekV3Router))]
    assert flagged and all(flagged)
    assert not any(m.batch_invariant for m in plain.model.modules()
                   if isinstance(m, (RMSNorm, DeepseekV3Router)))
    ids = PROMPTS[1]
    torch.testing.assert_close(invariant.logits(ids), plain.logits(ids), atol=1e-4, rtol=1e-4)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    batched = [o.token_ids for o in invariant.generate(PROMPTS, params)]
    alone = [invariant.generate([p], params)[0].token_ids for p in PROMPTS]
    assert batched == alone
