"""``kernelbay quantize --format fp8``: write the Hugging Face fine-grained FP8 dialect, as
DeepSeek-V3's and Qwen3's released FP8 checkpoints lay it out and transformers'
``FineGrainedFP8Config`` reads it (checked against transformers 5.24).

What is quantized: every linear layer (each 2-D ``<module>.weight`` that is not an embedding
or a norm) except ``lm_head`` and MoE routers (``mlp.gate``), including every routed
expert's and the shared experts' projections, and the attention projections.

Tensors of a quantized layer (the math is ``kernelbay.formats.fp8.quantize_fp8_per_block``)::

    <module>.weight            float8_e4m3fn [N, K]
    <module>.weight_scale_inv  float32 [ceil(N/128), ceil(K/128)]   amax(tile) / 448

``weight_scale_inv`` is, despite its name, the dequant multiplier (``w = q * s``); partial
edge tiles get the amax of the elements they have. Everything else (embeddings, norms,
``lm_head``, routers and their ``e_score_correction_bias``, biases) is copied unchanged.

Config: ``config.json`` gains ``quantization_config``::

    {"activation_scheme": "dynamic", "fmt": "e4m3", "modules_to_not_convert": [...],
     "quant_method": "fp8", "weight_block_size": [128, 128]}

the keys of DeepSeek-V3's release (``fmt`` is DeepSeek's; transformers ignores it) plus
``modules_to_not_convert`` as Qwen's FP8 releases and ``FineGrainedFP8Config`` spell it:
``lm_head`` and each router, the linear-shaped modules left in bf16 (transformers converts
``nn.Linear`` modules only, so embeddings and norms need no entry). The file is written as
``save_pretrained`` writes configs (2-space indent, sorted keys). Weights go to
``model.safetensors`` (metadata ``{"format": "pt"}``), or to
``model-0000i-of-0000n.safetensors`` shards plus ``model.safetensors.index.json`` past
``save_pretrained``'s default 50 GB shard size (``kernelbay.checkpoint.writing``).

Unlike the ModelOpt and Quark writers, layers past ``num_hidden_layers`` are kept (and
quantized): DeepSeek-V3's FP8 release ships its multi-token-prediction layer so; the engine
ignores them (``layout.beyond_layers``).
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from kernelbay.checkpoint.layout import plain_linear_modules
from kernelbay.errors import CheckpointError

if TYPE_CHECKING:
    import torch
    from kernelbay.checkpoint.folder import CheckpointFolder

__all__ = ["HF_FP8_BLOCK", "MAX_SHARD_BYTES", "hf_fp8_quantization_config", "is_router",
           "write_hf_fp8"]

#: The tile of one scale, (rows of N, columns of K): DeepSeek-V3's and transformers' default.
HF_FP8_BLOCK = (128, 128)
#: ``save_pretrained``'s default ``max_shard_size`` in transformers 5 ("50GB").
MAX_SHARD_BYTES = 50 * 10**9
_FLOAT_DTYPES = ("float32", "bfloat16", "float16")
# MoE routers stay in high precision: a ``gate`` directly under an MoE block (never
# ``gate_proj``), or anything named router.
_ROUTER_PARENTS = ("mlp", "block_sparse_moe", "moe")
_ROUTER_LEAVES = ("router", "shared_expert_gate")
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "uint8": 1,
                "int8": 1, "float8_e4m3fn": 1, "int64": 8, "int32": 4, "bool": 1}


def is_router(module: str) -> bool:
    """True for an MoE router (``model.layers.3.mlp.gate``, ``...router``)."""
    parts = module.split(".")
    if parts[-1] in _ROUTER_LEAVES:
        return True
    return parts[-1] == "gate" and len(parts) > 1 and parts[-2] in _ROUTER_PARENTS


def hf_fp8_quantization_config(unquantized: list[str]) -> dict[str, Any]:
    """``config.json``'s ``quantization_config`` (see the module docstring)."""
    return {"activation_scheme": "dynamic", "fmt": "e4m3",
            "modules_to_not_convert": list(unquantized), "quant_method": "fp8",
            "weight_block_size": list(HF_FP8_BLOCK)}


def write_hf_fp8(source: CheckpointFolder, destination: str, *, progress: bool = False) -> None:
    """Quantize the unquantized checkpoint ``source`` to Hugging Face fine-grained FP8 in
    ``destination`` (an existing empty folder): tensors and ``config.json``."""
    from kernelbay.checkpoint.writing import SourceTensors, write_shards
    from kernelbay.formats.fp8 import quantize_fp8_per_block

    with open(source.file("config.json"), encoding="utf-8") as f:
        config: dict[str, Any] = json.load(f)
    tensors = source.tensors
    quantized: dict[str, tuple[int, int]] = {}
    unquantized = ["lm_head"]  # the head module exists even when tied to the embedding
    for linear in plain_linear_modules(tensors):
        if linear.name == "lm_head" or is_router(linear.name):
            if linear.name not in unquantized:
                unquantized.append(linear.name)
            continue
        if linear.dtype not in _FLOAT_DTYPES:
            weight = f"{linear.name}.weight"
            raise CheckpointError(tensors[weight].file, f"is {linear.dtype}; FP8 quantization "
                                  f"reads unquantized weights in {_FLOAT_DTYPES}", tensor=weight)
        quantized[linear.name] = (linear.out_features, linear.in_features)

    bn, bk = HF_FP8_BLOCK
    # Sizes first, so shards are planned before any data is made; a quantized weight and
    # its scales are one unit and land in one file.
    units: list[tuple[str, int]] = []
    for name, info in sorted(tensors.items()):
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module in quantized:
            n, k = quantized[module]
            units.append((name, n * k + 4 * -(-n // bn) * -(-k // bk)))
        else:
            units.append((name, info.numel * _DTYPE_BYTES.get(info.dtype, 4)))
    read = SourceTensors(tensors)

    def produce(name: str) -> dict[str, torch.Tensor]:
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module in quantized:
            q, scale = quantize_fp8_per_block(read(name), HF_FP8_BLOCK)
            return {name: q, f"{module}.weight_scale_inv": scale}
        return {name: read(name)}

    write_shards(destination, units, produce, max_bytes=MAX_SHARD_BYTES, progress=progress,
                 index_sort_keys=True)
    config["quantization_config"] = hf_fp8_quantization_config(unquantized)
    with open(os.path.join(destination, "config.json"), "w", encoding="utf-8") as f:
        f.write(json.dumps(config, indent=2, sort_keys=True) + "\n")
