"""Tiny Hugging Face checkpoints made with transformers, for engine parity tests."""

from __future__ import annotations

import os
from typing import Any

import torch

LLAMA_FAMILY: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama", rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "mistral": dict(model_type="mistral", sliding_window=None),
    "qwen2": dict(model_type="qwen2"),
}


def save_tiny(path: str, family: str, seed: int = 0, dtype: torch.dtype = torch.float32,
              **overrides: Any) -> str:
    """A random tiny model of ``family`` saved with ``save_pretrained`` into ``path``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    fields: dict[str, Any] = dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=160, max_position_embeddings=256,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    fields.update(LLAMA_FAMILY[family])
    fields.update(overrides)
    model_type = fields.pop("model_type")
    config = AutoConfig.for_model(model_type, **fields)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():  # make every weight matter, biases included
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.5)
    model.save_pretrained(path)
    return path


def reference(path: str, dtype: torch.dtype = torch.float32) -> Any:
    """transformers' own model for ``path`` (the numerical reference)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def greedy_reference(model: Any, ids: list[int], n: int) -> list[int]:
    """``n`` greedy tokens from transformers, with EOS disabled."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return [int(t) for t in out[0, len(ids):]]


def tmp_model(tmp_path: Any, family: str, **kw: Any) -> str:
    return save_tiny(os.path.join(str(tmp_path), family), family, **kw)


DEEPSEEK_V3: dict[str, Any] = dict(
    vocab_size=160, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
    n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
    q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    max_position_embeddings=256, initializer_range=0.1, rms_norm_eps=1e-2,
    tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)


def save_tiny_deepseek(path: str, seed: int = 0, dtype: torch.dtype = torch.float32,
                       **overrides: Any) -> str:
    """A random tiny DeepSeek-V3 saved with ``save_pretrained`` into ``path``.

    Norm weights and the router's ``e_score_correction_bias`` are randomised so that every
    one of them matters (a wrong epsilon, a dropped norm or an ignored bias shows up), and
    the embedding has std 1 so that tokens route to different experts (with the default
    init a shared component dominates the hidden states and every token picks the same two).
    ``rms_norm_eps`` is 1e-2 so that using it for the latent norms (1e-6) would show.
    """
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    fields = dict(DEEPSEEK_V3)
    fields.update(overrides)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**fields)).to(dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.3 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.normal_(0, 0.5)
            elif name.endswith("embed_tokens.weight"):
                param.normal_(0, 1.0)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0, 0.1)
    model.save_pretrained(path)
    return path


def deepseek_reference(path: str, dtype: torch.dtype = torch.float32) -> Any:
    """transformers' DeepseekV3 for ``path`` with eager attention and eager experts."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager",
                                                experts_implementation="eager").eval()


def free_port() -> int:
    """A free TCP port on the loopback interface, for a gloo process group."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tp_rank(rank: int, path: str, prompts: list[list[int]], max_tokens: int, port: int,
             results: dict[int, list[list[int]]]) -> None:
    import torch.distributed as dist
    from kernelbay import Policy, Registry
    from kernelbay.engine import LLM, SamplingParams

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        llm = LLM(path, device="cpu", dtype="float32", tensor_parallel_size=2,
                  registry=Registry(Policy(plugins=frozenset())))
        assert llm.plan.collective is not None
        outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        results[rank] = [o.token_ids for o in outs]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def greedy_tp2(path: str, prompts: list[list[int]], max_tokens: int) -> dict[int, Any]:
    """Greedy tokens of each of two gloo ranks running ``path`` with tensor parallel 2."""
    import torch.multiprocessing as mp

    results = mp.Manager().dict()
    mp.spawn(_tp_rank, args=(path, prompts, max_tokens, free_port(), results), nprocs=2,
             join=True)
    return dict(results)
