"""The engine against transformers on tiny random DeepSeek-V3 checkpoints (MLA + MoE), and
tensor parallel over gloo against one process."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from engine_helpers import deepseek_reference, greedy_tp2, save_tiny_deepseek
from kernelbay import Policy, Registry
from kernelbay.engine import LLM, SamplingParams
from kernelbay.engine.models.deepseek_v3 import DeepseekV3ForCausalLM, mla_softmax_scale

CORE_ONLY = Registry(Policy(plugins=frozenset()))
PROMPT = [0, 17, 42, 99, 5, 5, 63, 120, 7, 33, 150, 2, 9, 11, 80, 81]
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}
# Seeds picked so that tokens route to several expert pairs and greedy decoding does not
# settle into repeating one token (random tiny models often do; tied embeddings always do).
CASES: dict[str, dict[str, Any]] = {
    # q_proj, default rope in the half-split layout
    "q_proj": dict(q_lora_rank=None, rope_interleave=False, seed=0),
    # q_a/q_b with q_a_layernorm, yarn + mscale, interleaved rope, attention biases
    "q_lora_yarn": dict(q_lora_rank=24, rope_parameters=YARN, attention_bias=True, seed=1),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> tuple[str, Any]:
    name = request.param
    path = save_tiny_deepseek(str(tmp_path_factory.mktemp(name)), **CASES[name])
    return path, deepseek_reference(path)


def test_fp32_logits_match_transformers(case: tuple[str, Any]) -> None:
    path, reference = case
    llm = LLM(path, device="cpu", dtype="float32", registry=CORE_ONLY)
    routes: list[set[tuple[int, ...]]] = []
    for layer in llm.model.model.layers[1:]:
        layer.mlp.gate.register_forward_hook(lambda module, args, out: routes.append(
            {tuple(sorted(row)) for row in out[0].tolist()}))
    ours = llm.logits(PROMPT)
    with torch.no_grad():
        theirs = reference(torch.tensor([PROMPT])).logits[0]
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    assert len(routes) == 2 and all(len(r) >= 3 for r in routes)  # the router really routes


def test_bf16_logits_within_tolerance(case: tuple[str, Any]) -> None:
    # bf16 through three layers (router in float32 on both sides): max |diff| <= 3% of the
    # reference's max |logit|, as for the Llama family.
    path, _ = case
    ours = LLM(path, device="cpu", dtype="bfloat16", registry=CORE_ONLY).logits(PROMPT)
    with torch.no_grad():
        reference = deepseek_reference(path, torch.bfloat16)
        theirs = reference(torch.tensor([PROMPT])).logits[0].float()
    assert (ours - theirs).abs().max() <= 0.03 * theirs.abs().max()


def test_32_greedy_tokens_match_transformers(case: tuple[str, Any]) -> None:
    path, reference = case
    llm = LLM(path, device="cpu", dtype="float32", registry=CORE_ONLY)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=32, ignore_eos=True))[0]
    with torch.no_grad():
        ids = torch.tensor([PROMPT])
        theirs = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32,
                                    do_sample=False, eos_token_id=None)
    assert out.token_ids == theirs[0, len(PROMPT):].tolist()
    assert len(out.token_ids) == 32 and len(set(out.token_ids)) > 8


def test_plan_and_batched_generation(case: tuple[str, Any]) -> None:
    path, _ = case
    llm = LLM(path, dtype="float32", registry=CORE_ONLY, max_num_seqs=4)
    plan = llm.plan
    assert plan.ok and plan.attention.chosen == "torch-mla"
    experts = {d.module: d.chosen for d in plan.linears if d.module.endswith(".experts")}
    assert experts == {"model.layers.1.mlp.experts": "torch-moe",
                       "model.layers.2.mlp.experts": "torch-moe"}
    assert {d.chosen for d in plan.linears} == {"torch-moe", "torch-unquantized"}
    prompts = [PROMPT[:n] for n in (1, 5, 16)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    together = [o.token_ids for o in llm.generate(prompts, params)]
    assert together == [llm.generate([p], params)[0].token_ids for p in prompts]


def test_runs_on_the_flashmla_plugin_backend(tmp_path: object) -> None:
    # The plugin's MLA records exist for DeepSeek's latent shape (512 + 64): same query,
    # latent and output layout as torch-mla, so the same model runs on either.
    pytest.importorskip("kernelbay_attn_flashmla")
    path = save_tiny_deepseek(os.path.join(str(tmp_path), "mla512"), seed=1, kv_lora_rank=512,
                              qk_rope_head_dim=64)
    plugin = Registry.discover(Policy(plugins=frozenset({"attn_flashmla"})))
    core = LLM(path, device="cpu", dtype="bfloat16", registry=CORE_ONLY).logits(PROMPT)
    spread = core.abs().max()
    for kv_cache, tolerance in (("auto", 0.03), ("fp8", 0.08)):
        llm = LLM(path, device="cpu", dtype="bfloat16", kv_cache=kv_cache, registry=plugin)
        assert llm.plan.attention.chosen == "mla-reference"
        assert (llm.logits(PROMPT) - core).abs().max() <= tolerance * spread


def test_softmax_scale_follows_transformers() -> None:
    assert mla_softmax_scale(24, None) == pytest.approx(24 ** -0.5)
    assert mla_softmax_scale(24, YARN) == pytest.approx(0.26464, abs=1e-5)
    assert mla_softmax_scale(24, {**YARN, "mscale_all_dim": 0}) == pytest.approx(24 ** -0.5)


def test_ignores_rotary_caches_and_mtp_layers() -> None:
    from kernelbay.checkpoint.config import ModelConfig

    config = ModelConfig(num_hidden_layers=3)
    ignored = DeepseekV3ForCausalLM.ignored_tensor
    assert ignored("model.layers.3.eh_proj.weight", config)
    assert ignored("model.layers.3.mlp.experts.0.up_proj.weight", config)
    assert ignored("model.layers.0.self_attn.rotary_emb.inv_freq", config)
    assert not ignored("model.layers.2.mlp.experts.0.up_proj.weight", config)
    assert not ignored("lm_head.weight", config)


# -- tensor parallel ----------------------------------------------------------------------

TP_PROMPTS = [[0, 17, 42, 99, 5], [0, 3, 3, 3, 3, 3, 8, 150]]


def test_tp2_gloo_matches_tp1(tmp_path: object) -> None:
    # q_lora + attention biases: replicated q_a/kv_a, column q_b/kv_b, row o_proj with bias;
    # vocab 163 does not divide by 2 (padded vocabulary shards).
    path = save_tiny_deepseek(os.path.join(str(tmp_path), "tp"), seed=1, q_lora_rank=24,
                              attention_bias=True, rope_parameters=YARN, vocab_size=163)
    single = LLM(path, dtype="float32", registry=CORE_ONLY)
    expected = [o.token_ids for o in single.generate(
        TP_PROMPTS, SamplingParams(max_tokens=16, ignore_eos=True))]
    results = greedy_tp2(path, TP_PROMPTS, 16)
    assert results[0] == expected and results[1] == expected
