"""Latent MoE (DeepSeek-V3 family, ``moe_latent_size``): one all-reduce per block when the
back-projection is linear and unquantized, the same result as the two-reduce path under
gloo with two ranks; a quantized back-projection keeps two reduces."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from engine_helpers import free_port, save_tiny_deepseek
from kernelbay import LayerRole, LinearRequest, Policy, QuantScheme, Registry
from kernelbay.engine import LLM
from kernelbay.engine.models.deepseek_v3 import DeepseekV3MoE, latent_reduces_once
from kernelbay.engine.modules import Linear
from kernelbay.engine.parallel import TensorParallel
from kernelbay.formats.fp8 import quantize_fp8_per_tensor
from kernelbay.layers.torch_fp8_linear import TorchFp8DequantLinear

LATENT = 24
IDS = [0, 17, 42, 99, 5, 3, 3, 3, 150, 8, 61]
CORE = Policy(plugins=frozenset())


def _latent_checkpoint(path: str) -> str:
    """A tiny DeepSeek-V3 whose MoE layers carry latent projections and latent experts."""
    from safetensors.torch import load_file, save_file

    save_tiny_deepseek(path)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    hidden = config["hidden_size"]
    g = torch.Generator().manual_seed(11)
    for name in list(tensors):
        if ".mlp.experts." in name:
            w = tensors[name]
            shape = (w.shape[0], LATENT) if "down_proj" not in name else (LATENT, w.shape[1])
            tensors[name] = torch.randn(shape, generator=g) * 0.2
    for layer in range(config["first_k_dense_replace"], config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.mlp"
        tensors[f"{prefix}.fc1_latent_proj.weight"] = torch.randn(LATENT, hidden, generator=g) * 0.2
        tensors[f"{prefix}.fc2_latent_proj.weight"] = torch.randn(hidden, LATENT, generator=g) * 0.2
    save_file(tensors, file, metadata={"format": "pt"})
    config["moe_latent_size"] = LATENT
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    return path


def _moe_blocks(llm: LLM) -> list[DeepseekV3MoE]:
    return [m for m in llm.model.modules() if isinstance(m, DeepseekV3MoE)]


def _rank(rank: int, path: str, port: int, results: dict[int, Any]) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        llm = LLM(path, device="cpu", dtype="float32", tensor_parallel_size=2, registry=Registry(CORE))
        calls = [0]
        reduce = llm.tp.collective.all_reduce

        def counted(x: torch.Tensor) -> torch.Tensor:
            calls[0] += 1
            return reduce(x)

        llm.tp.collective.all_reduce = counted
        blocks = _moe_blocks(llm)
        once_flags = [b.reduce_once for b in blocks]
        once = llm.logits(IDS)
        once_calls = calls[0]
        for b in blocks:
            b.reduce_once = False
        calls[0] = 0
        twice = llm.logits(IDS)
        results[rank] = {"once": once, "twice": twice, "once_calls": once_calls,
                         "twice_calls": calls[0], "flags": once_flags, "blocks": len(blocks)}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_one_all_reduce_per_latent_block_equals_two_under_gloo_tp2(tmp_path: Any) -> None:
    path = _latent_checkpoint(os.path.join(str(tmp_path), "latent"))
    single = LLM(path, device="cpu", dtype="float32", registry=Registry(CORE)).logits(IDS)
    results = mp.Manager().dict()
    mp.spawn(_rank, args=(path, free_port(), results), nprocs=2, join=True)
    for rank in (0, 1):
        r = results[rank]
        assert r["blocks"] == 2 and r["flags"] == [True, True]
        # every block saves exactly one all-reduce on the one-reduce path
        assert r["twice_calls"] - r["once_calls"] == r["blocks"]
        torch.testing.assert_close(r["once"], r["twice"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(r["once"], single, atol=1e-4, rtol=1e-4)
        assert torch.equal(r["once"].argmax(-1), r["twice"].argmax(-1))


class _Doubling:
    """A two-rank stand-in whose twin holds the same partial sums; counts all-reduces."""

    def __init__(self) -> None:
        self.calls = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * 2


def test_quantized_back_projection_keeps_two_reduces(tmp_path: Any) -> None:
    path = _latent_checkpoint(os.path.join(str(tmp_path), "latent"))
    llm = LLM(path, device="cpu", dtype="float32", registry=Registry(CORE))
    block = _moe_blocks(llm)[0]
    assert block.fc2_latent_proj is not None and latent_reduces_once(block.fc2_latent_proj)
    dense = block.fc2_latent_proj.weight.detach()
    request = LinearRequest(LATENT, dense.shape[0], QuantScheme("fp8", "float8_e4m3fn"),
                            "float32", role=LayerRole.OTHER)
    quantized = Linear(TorchFp8DequantLinear(request), TensorParallel(), torch.device("cpu"))
    q, scale = quantize_fp8_per_tensor(dense)
    with torch.no_grad():
        quantized.weight.copy_(q)
        quantized.weight_scale.copy_(scale)
    quantized.method.process_weights_after_loading(quantized)
    assert not latent_reduces_once(quantized)  # decided from the layer's own method

    x = torch.randn(5, dense.shape[0], generator=torch.Generator().manual_seed(3))
    counts = {}
    for label, proj in (("unquantized", block.fc2_latent_proj), ("fp8", quantized)):
        recorder = _Doubling()
        block.fc2_latent_proj = proj
        block.reduce_once = latent_reduces_once(proj)
        block.tp = TensorParallel(0, 2, None, recorder)
        block(x)
        counts[label] = recorder.calls
    assert counts == {"unquantized": 1, "fp8": 2}
