"""ModelOpt FP8 checkpoints (read by kernelbay-quant-nvfp4) run on kernelbay-cpu-amx's
compiled kernels, and agree with the core's FP8 reference on the same checkpoint."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
from kernelbay import Policy, get_registry
from kernelbay.engine import LLM
from kernelbay.formats.fp8 import quantize_fp8_per_block, quantize_fp8_per_tensor
from kernelbay.testing.checkpoints import llama_config, write_checkpoint

pytest.importorskip("kernelbay_quant_nvfp4")
pytest.importorskip("kernelbay_cpu_amx")

SHAPES = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=256, dtype="bfloat16")
PROMPT = [1, 9, 77, 200, 3, 3, 150, 42, 8]


def _write(path: str, algo: str) -> str:
    config = llama_config(**SHAPES)
    gen = torch.Generator().manual_seed(7)
    d = config["hidden_size"] // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * d
    h, i = config["hidden_size"], config["intermediate_size"]
    linears = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h),
               "self_attn.v_proj": (kv, h), "self_attn.o_proj": (h, h),
               "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}
    tensors: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(256, h, generator=gen).bfloat16(),
        "lm_head.weight": (torch.randn(256, h, generator=gen) * h ** -0.5).bfloat16(),
        "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        tensors[p + "input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        for name, (rows, cols) in linears.items():
            w = torch.randn(rows, cols, generator=gen) * cols ** -0.5
            if algo == "FP8":
                q, s = quantize_fp8_per_tensor(w)
                tensors[p + name + ".input_scale"] = torch.tensor(0.02)
            else:
                q, s = quantize_fp8_per_block(w, (128, 128))
            tensors[p + name + ".weight"], tensors[p + name + ".weight_scale"] = q, s
    quant: dict[str, Any] = {"quant_algo": algo, "kv_cache_quant_algo": None,
                             "exclude_modules": ["lm_head"]}
    config["quantization_config"] = {"quant_method": "modelopt", **quant}
    return write_checkpoint(path, config, tensors, {"hf_quant_config.json": {
        "producer": {"name": "modelopt", "version": "0.47.0"}, "quantization": quant}})


@pytest.mark.cpu_isa("avx512_bf16", "avx512bw", "avx512vl")
@pytest.mark.parametrize("algo", ["FP8", "FP8_PB_WO"])
def test_modelopt_fp8_runs_on_the_cpu_kernels(tmp_path: Any, algo: str) -> None:
    path = _write(os.path.join(str(tmp_path), algo), algo)
    fast = LLM(path, registry=get_registry(Policy(plugins=frozenset({"quant_nvfp4",
                                                                      "cpu_amx"}))))
    chosen = {d.module: d.chosen for d in fast.plan.linears}
    assert fast.plan.format.chosen == "modelopt"
    assert chosen["model.layers.0.self_attn.q_proj"] == "cpu-fp8-avx512"
    assert chosen["model.layers.1.mlp.down_proj"] == "cpu-fp8-avx512"
    reference = LLM(path, registry=get_registry(Policy(plugins=frozenset({"quant_nvfp4"}))))
    assert {d.chosen for d in reference.plan.linears if d.module != "lm_head"} == {
        "torch-fp8-dequant"}
    ours, theirs = fast.logits(PROMPT), reference.logits(PROMPT)
    # Both compute in bf16 from the same FP8 weights; kernels differ in accumulation order.
    assert (ours - theirs).abs().max() <= 0.02 * theirs.abs().max()
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["quantization_config"]["quant_algo"] == algo
