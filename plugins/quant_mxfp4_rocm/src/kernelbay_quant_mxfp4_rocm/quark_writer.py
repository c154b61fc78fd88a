"""``kernelbay quantize --format quark-mxfp4``: write what AMD Quark's ``export_safetensors``
writes for a model quantized with ``LLMTemplate.get(model_type).get_config("mxfp4")``: OCP
MXFP4 weights and dynamic MXFP4 activations (W4A4), scale rule ``even``, checked against
amd-quark 0.13 (see the README).

What is quantized: every ``nn.Linear`` of the transformers model except those the model
type's Quark template excludes (``TEMPLATE_EXCLUDES``: ``lm_head``; for DeepSeek-V3 also all
attention, ``*self_attn*``). MoE routers are not ``nn.Linear`` in transformers, so Quark never
touches them. Routed experts are quantized per expert (``experts.{e}.{gate,up,down}_proj``),
as Quark does with transformers 4.57 (with transformers 5.x, whose fused 3-D experts Quark
0.13 does not quantize, the experts would stay bf16 under fused names).

Tensors of a quantized layer (``kernelbay.formats.quantize_mx``, rule ``even``):

    weight        uint8 [N, K/2]   packed E2M1 (element 2i in the low nibble)
    weight_scale  uint8 [N, K/32]  E8M0 bytes

No activation scales (activations are dynamic). Quark writes a negative value that rounds to
zero as +0 (code 0) where the reference keeps the sign (code 8); both read back as zero, and
the writer clears the sign so the bytes are Quark's. Everything else is copied in its source
dtype. Tensors transformers does not load (layers past ``num_hidden_layers``, rotary caches)
are not written; shards follow transformers 4.57's ``save_pretrained`` 5 GB limit.

``config.json`` is the source config plus ``quantization_config`` (``QConfig.to_dict()`` and
the exporter's ``export`` block), written like transformers (indent 2, sorted keys);
``exclude`` lists the excluded linear modules by name, in the model's module order.
"""

from __future__ import annotations

import fnmatch
import json
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from kernelbay.checkpoint.layout import beyond_layers, plain_linear_modules
from kernelbay.checkpoint.writing import SourceTensors, write_shards
from kernelbay.errors import CheckpointError, ConfigError

from kernelbay_quant_mxfp4_rocm.quark_config import MX_GROUP, is_router

if TYPE_CHECKING:
    import torch
    from kernelbay.checkpoint.folder import CheckpointFolder
    from kernelbay.checkpoint.tensors import TensorInfo

__all__ = ["QUARK_VERSION", "TEMPLATE_EXCLUDES", "hf_module_order", "quark_mxfp4_config",
           "write_quark_mxfp4"]

#: The amd-quark release whose export this writer reproduces.
QUARK_VERSION = "0.13"
#: ``exclude_layers_name`` of amd-quark 0.13's ``LLMTemplate`` per ``model_type``, for the
#: families kernelbay's engine runs.
TEMPLATE_EXCLUDES: dict[str, tuple[str, ...]] = {
    "llama": ("lm_head",),
    "mistral": ("lm_head",),
    "qwen2": ("lm_head",),
    "deepseek_v3": ("lm_head", "*self_attn*", "*mlp.gate"),
}
#: transformers 4.57's ``save_pretrained`` default ``max_shard_size`` ("5GB").
MAX_SHARD_BYTES = 5 * 10**9
#: Position of a module name component among its siblings in the transformers model
#: (``named_modules`` order); other components sort after these, by name.
_MODULE_ORDER = {
    "model": 0, "lm_head": 1, "embed_tokens": 0, "layers": 1, "norm": 2,
    "self_attn": 0, "mlp": 1,
    "q_proj": 0, "q_a_proj": 0, "q_b_proj": 1, "k_proj": 1, "v_proj": 2,
    "kv_a_proj_with_mqa": 2, "kv_b_proj": 3, "o_proj": 4,
    "experts": 0, "gate": 1, "shared_experts": 2,
    "gate_proj": 0, "up_proj": 1, "down_proj": 2,
}
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "uint8": 1}
_FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def hf_module_order(name: str) -> tuple[tuple[int, int, str], ...]:
    """Sort key putting module names in the order transformers registers the modules
    (layer indices numerically; ``self_attn`` before ``mlp``; q, k, v, o; gate, up, down)."""
    key = []
    for part in name.split("."):
        if part.isdigit():
            key.append((0, int(part), ""))
        else:
            key.append((1, _MODULE_ORDER.get(part, 99), part))
    return tuple(key)


def _spec(dynamic: bool) -> dict[str, Any]:
    # QTensorConfig.to_dict() of OCP_MXFP4Spec(ch_axis=-1, is_dynamic=...) in amd-quark 0.13.
    return {"block_size": None, "ch_axis": -1, "dtype": "fp4", "enable_buffer_reuse": False,
            "group_size": MX_GROUP, "is_dynamic": dynamic, "is_scale_quant": False,
            "max_input_numel": 4194304, "mx_element_dtype": None,
            "observer_cls": "PerBlockMXObserver", "qscheme": "per_group",
            "round_method": "half_even", "scale_calculation_mode": "even",
            "scale_format": "e8m0", "scale_type": "float", "symmetric": None,
            "zero_point_type": "int32"}


def quark_mxfp4_config(exclude: list[str]) -> dict[str, Any]:
    """``config.json``'s ``quantization_config`` for Quark's ``mxfp4`` template scheme."""
    return {
        "algo_config": None,
        "exclude": list(exclude),
        "export": {"kv_cache_group": [], "min_kv_scale": 0.0, "pack_method": "reorder",
                   "weight_format": "real_quantized", "weight_merge_groups": None},
        "global_quant_config": {"bias": None, "input_tensors": _spec(True),
                                "output_tensors": None, "target_device": None,
                                "weight": _spec(False)},
        "kv_cache_post_rope": False,
        "kv_cache_quant_config": {},
        "layer_quant_config": {},
        "layer_type_quant_config": {},
        "quant_method": "quark",
        "quant_mode": "eager_mode",
        "softmax_quant_spec": None,
        "version": QUARK_VERSION,
    }


def _excluded(module: str, patterns: Iterable[str]) -> bool:
    # Quark: exact names first, then fnmatch patterns.
    return any(module == p or fnmatch.fnmatch(module, p) for p in patterns)


def _quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    import torch
    from kernelbay.formats import pack_e2m1, quantize_mx, unpack_e2m1

    packed, scales = quantize_mx(weight, "e2m1", "even")
    codes = unpack_e2m1(packed)
    # Code 8 is -0: Quark writes the unsigned zero (same value, Quark's bytes).
    return pack_e2m1(torch.where(codes == 8, 0, codes).to(torch.uint8)), scales


def write_quark_mxfp4(source: CheckpointFolder, destination: str, *,
                      progress: bool = False) -> None:
    """Quantize the unquantized checkpoint ``source`` to Quark MXFP4 (W4A4, dynamic MXFP4
    activations) in ``destination`` (an existing empty folder)."""
    with open(source.file("config.json"), encoding="utf-8") as f:
        config: dict[str, Any] = json.load(f)
    model_type = config.get("model_type")
    if model_type not in TEMPLATE_EXCLUDES:
        raise ConfigError(f"{source.file('config.json')}: model_type {model_type!r} has no "
                          f"Quark template here; supported: {sorted(TEMPLATE_EXCLUDES)}")
    patterns = TEMPLATE_EXCLUDES[model_type]
    tensors: dict[str, TensorInfo] = {n: i for n, i in source.tensors.items()
                                      if not beyond_layers(n, config.get("num_hidden_layers"))}
    names = [m.name for m in plain_linear_modules(tensors) if not is_router(m.name)]
    if "lm_head" not in names:
        names.append("lm_head")  # the head module exists even when tied to the embedding
    exclude = sorted((m for m in names if _excluded(m, patterns)), key=hf_module_order)
    quantized: dict[str, tuple[int, int]] = {}
    for linear in plain_linear_modules(tensors):
        if linear.name in exclude or is_router(linear.name):
            continue
        weight = f"{linear.name}.weight"
        if linear.dtype not in _FLOAT_DTYPES:
            raise CheckpointError(tensors[weight].file, f"is {linear.dtype}; MXFP4 quantization "
                                  f"reads unquantized weights in {_FLOAT_DTYPES}", tensor=weight)
        if linear.in_features % MX_GROUP:
            raise CheckpointError(tensors[weight].file, f"has K={linear.in_features}, not a "
                                  f"multiple of the MX block {MX_GROUP}", tensor=weight)
        quantized[linear.name] = (linear.out_features, linear.in_features)

    # Sizes first, so shards are planned before any data is made; a quantized weight and
    # its scales are one unit and land in one file.
    units: list[tuple[str, int]] = []
    for name, info in sorted(tensors.items()):
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module in quantized:
            n, k = quantized[module]
            units.append((name, n * k // 2 + n * k // MX_GROUP))
        else:
            units.append((name, info.numel * _DTYPE_BYTES.get(info.dtype, 4)))
    read = SourceTensors(tensors)

    def produce(name: str) -> dict[str, torch.Tensor]:
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module in quantized:
            weight, scales = _quantize(read(name))
            return {name: weight, f"{module}.weight_scale": scales}
        return {name: read(name)}

    write_shards(destination, units, produce, max_bytes=MAX_SHARD_BYTES, progress=progress,
                 index_sort_keys=True)
    with open(os.path.join(destination, "config.json"), "w", encoding="utf-8") as f:
        f.write(json.dumps({**config, "quantization_config": quark_mxfp4_config(exclude)},
                           indent=2, sort_keys=True) + "\n")
