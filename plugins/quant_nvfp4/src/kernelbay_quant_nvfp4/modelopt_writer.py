"""``kernelbay quantize --format modelopt-nvfp4``: write what NVIDIA ModelOpt's
``export_hf_checkpoint`` writes for a model quantized with ``NVFP4_DEFAULT_CFG`` (W4A4,
``max`` calibration), checked against nvidia-modelopt 0.47.0 (see the README).

What is quantized: every linear layer except ``lm_head``, embeddings and MoE routers
(ModelOpt's default config disables those), including each routed expert's projections.

Tensors of a quantized layer (``kernelbay.formats`` does the math):

    weight          uint8 [N, K/2]          packed E2M1
    weight_scale    float8_e4m3fn [N, K/16] block scales
    weight_scale_2  float32 []              amax_w / (6 * 448)
    input_scale     float32 []              amax_x / (6 * 448), from calibration

Shared scales, as ModelOpt's exporter unifies them (``requantize_resmooth_fused_llm_layers``):
layers that read one input tensor (q/k/v, q_a_proj + kv_a_proj_with_mqa, gate/up) take the
max of their weight amaxes and of their input amaxes; each routed expert's gate and up share
one weight amax (ModelOpt quantizes the fused ``gate_up_proj`` of transformers 5 per expert);
all experts of a block share one gate/up input amax and one down input amax (one input
quantizer per projection for the fused experts).

Everything else is copied in its source dtype, except DeepSeek routers'
``e_score_correction_bias``, which transformers 5 keeps in float32 and ModelOpt writes so.
Tensors transformers does not load (layers past ``num_hidden_layers``, such as DeepSeek's
multi-token-prediction layer, and rotary caches) are not written. Shards follow
``save_pretrained``'s 10 GB limit; the files carry safetensors metadata ``{"format": "pt"}``.

Config: ``hf_quant_config.json`` (``producer``, ``quantization``: ``quant_algo``,
``kv_cache_quant_algo``, ``group_size``, ``exclude_modules``) and ``config.json`` with
``quantization_config`` made from it by ModelOpt's ``convert_hf_quant_config_format``.
``exclude_modules`` lists the unquantized lm_head, embeddings and routers, summarised with
ModelOpt's prefix-wildcard rule (``summarize_exclude_modules``) and sorted.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from kernelbay.checkpoint.layout import beyond_layers, plain_linear_modules
from kernelbay.checkpoint.writing import SourceTensors, write_shards
from kernelbay.errors import CheckpointError

from kernelbay_quant_nvfp4.matching import is_never_quantized
from kernelbay_quant_nvfp4.schemes import FLOAT_DTYPES, NVFP4_BLOCK

if TYPE_CHECKING:
    import torch
    from kernelbay.checkpoint.folder import CheckpointFolder
    from kernelbay.checkpoint.tensors import TensorInfo

    from kernelbay_quant_nvfp4.calibration import Calibration

__all__ = ["MODELOPT_VERSION", "modelopt_quant_configs", "summarize_exclude_modules",
           "write_modelopt_nvfp4"]

#: The ModelOpt release whose export this writer reproduces (written as the producer).
MODELOPT_VERSION = "0.47.0"
#: ``save_pretrained``'s default ``max_shard_size`` ("10GB") as ModelOpt passes it.
MAX_SHARD_BYTES = 10 * 10**9
_EXPERT = re.compile(r"^(?P<block>.+)\.experts\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|"
                     r"down_proj)$")
_EMBEDDING_PARTS = ("embed_tokens", "embed", "wte")
_FLOAT32_TENSORS = ("e_score_correction_bias",)
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "uint8": 1,
                "float8_e4m3fn": 1, "int64": 8, "int32": 4}


def summarize_exclude_modules(unquantized: Iterable[str], quantized: Iterable[str]) -> set[str]:
    """ModelOpt's ``_prefix_wildcard_summarize_exclude_modules``: cover the unquantized
    modules with the shortest prefix wildcards (cut at dots) that match no quantized one."""
    negative: set[str] = set()
    for layer in quantized:
        negative.add(layer)
        negative.update(layer[:i] + "*" for i in range(len(layer) + 1))

    def candidates(name: str) -> Iterator[list[str]]:
        for i, char in enumerate(name):
            if char == ".":
                yield [name[:i] + "*"]
                yield [name[:i], name[:i] + ".*"]
        yield [name]

    summary: set[str] = set()
    for layer in unquantized:
        chosen: list[str] = []
        for wildcards in candidates(layer):
            if any(w in negative for w in wildcards):
                continue
            if all(w in summary for w in wildcards):
                chosen = []
                break
            chosen = wildcards
            break
        if len(chosen) == 2 and chosen[1] == chosen[0] + ".*":
            summary.add(chosen[1])  # ModelOpt emits only "prefix.*" of the pair
        else:
            summary.update(chosen)
    return summary


def modelopt_quant_configs(exclude: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(hf_quant_config.json, config.json's quantization_config)`` for NVFP4, as ModelOpt
    writes them (``get_quant_config`` and ``convert_hf_quant_config_format``)."""
    producer = {"name": "modelopt", "version": MODELOPT_VERSION}
    hf_quant = {"producer": producer,
                "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None,
                                 "group_size": NVFP4_BLOCK, "exclude_modules": exclude}}
    args = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": NVFP4_BLOCK}
    config = {"config_groups": {"group_0": {"input_activations": dict(args),
                                            "weights": dict(args), "targets": ["Linear"]}},
              "ignore": list(exclude), "quant_algo": "NVFP4", "producer": dict(producer),
              "quant_method": "modelopt"}
    return hf_quant, config


def _is_embedding(name: str, info: TensorInfo) -> bool:
    leaf = name.removesuffix(".weight").rsplit(".", 1)[-1]
    return (name.endswith(".weight") and len(info.shape) == 2
            and any(p in leaf for p in _EMBEDDING_PARTS))


def _groups(quantized: Iterable[str], calibration: Calibration) -> dict[str, tuple[str, ...]]:
    """Module -> the modules whose weight scales it shares (itself included)."""
    names = set(quantized)
    group: dict[str, tuple[str, ...]] = {m: (m,) for m in names}
    for shared in calibration.shared_inputs:
        members = tuple(m for m in shared if m in names)
        for m in members:
            group[m] = members
    for m in names:
        match = _EXPERT.match(m)
        if match and match["proj"] != "down_proj":
            prefix = f"{match['block']}.experts.{match['expert']}"
            pair = tuple(f"{prefix}.{p}" for p in ("gate_proj", "up_proj"))
            group[m] = tuple(p for p in pair if p in names)
    return group


def _input_amax(module: str, group: tuple[str, ...], calibration: Calibration) -> float | None:
    match = _EXPERT.match(module)
    if match:
        seen = calibration.experts.get(match["block"])
        if seen is None:
            return None
        return seen[1] if match["proj"] == "down_proj" else seen[0]
    values = [calibration.amax[m] for m in group if m in calibration.amax]
    return max(values) if values else None


def write_modelopt_nvfp4(source: CheckpointFolder, destination: str, *,
                         progress: bool = False) -> None:
    """Quantize the unquantized checkpoint ``source`` to ModelOpt NVFP4 in ``destination``
    (an existing empty folder): tensors, ``config.json`` and ``hf_quant_config.json``."""
    import torch
    from kernelbay.formats import nvfp4_global_scale, quantize_nvfp4

    from kernelbay_quant_nvfp4.calibration import calibrate, calibration_text

    with open(source.file("config.json"), encoding="utf-8") as f:
        config: dict[str, Any] = json.load(f)
    tensors = {n: i for n, i in source.tensors.items() if not beyond_layers(n, config.get("num_hidden_layers"))}
    read = SourceTensors(tensors)
    quantized: dict[str, tuple[int, int]] = {}
    unquantized = ["lm_head"]  # the head module exists even when tied to the embedding
    for linear in plain_linear_modules(tensors):
        if is_never_quantized(linear.name):
            if linear.name not in unquantized:
                unquantized.append(linear.name)
            continue
        weight = f"{linear.name}.weight"
        if linear.dtype not in FLOAT_DTYPES:
            raise CheckpointError(tensors[weight].file, f"is {linear.dtype}; NVFP4 quantization "
                                  f"reads unquantized weights in {FLOAT_DTYPES}", tensor=weight)
        if linear.in_features % NVFP4_BLOCK:
            raise CheckpointError(tensors[weight].file, f"has K={linear.in_features}, not a "
                                  f"multiple of the NVFP4 block {NVFP4_BLOCK}", tensor=weight)
        quantized[linear.name] = (linear.out_features, linear.in_features)
    unquantized += [n.removesuffix(".weight") for n, i in tensors.items() if _is_embedding(n, i)]

    def expert_weights(block: str, expert: int, proj: str) -> torch.Tensor:
        return read(f"{block}.experts.{expert}.{proj}.weight")

    calibration = calibrate(source.path, calibration_text(), expert_weights, progress=progress)
    groups = _groups(quantized, calibration)
    missing = sorted(m for m in quantized if _input_amax(m, groups[m], calibration) is None)
    if missing:
        raise CheckpointError(source.path, f"{len(missing)} quantized layer(s) saw no input "
                              f"while calibrating, so they have no input_scale: {missing[:8]}")
    weight_amax = {m: float(read(f"{m}.weight").float().abs().amax()) for m in quantized}

    def scale(amax: float) -> torch.Tensor:
        return nvfp4_global_scale(torch.tensor(amax, dtype=torch.float32)).reshape(())

    # Sizes first, so shards are planned before any data is made; a quantized weight and
    # its scales are one unit and land in one file.
    units: list[tuple[str, int]] = []
    for name, info in sorted(tensors.items()):
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module in quantized:
            n, k = quantized[module]
            units.append((name, n * k // 2 + n * k // NVFP4_BLOCK + 8))
        else:
            dtype = "float32" if name.endswith(_FLOAT32_TENSORS) else info.dtype
            units.append((name, info.numel * _DTYPE_BYTES.get(dtype, 4)))
    def produce(name: str) -> dict[str, torch.Tensor]:
        module = name.removesuffix(".weight")
        if not (name.endswith(".weight") and module in quantized):
            value = read(name)
            return {name: value.float() if name.endswith(_FLOAT32_TENSORS) else value}
        group = groups[module]
        packed, block_scales, g = quantize_nvfp4(
            read(name), scale(max(weight_amax[m] for m in group)))
        return {name: packed, f"{module}.weight_scale": block_scales,
                f"{module}.weight_scale_2": g,
                f"{module}.input_scale": scale(_input_amax(module, group, calibration) or 0.0)}

    write_shards(destination, units, produce, max_bytes=MAX_SHARD_BYTES, progress=progress)
    exclude = sorted(summarize_exclude_modules(unquantized, quantized))
    hf_quant, quantization_config = modelopt_quant_configs(exclude)
    with open(os.path.join(destination, "hf_quant_config.json"), "w", encoding="utf-8") as f:
        json.dump(hf_quant, f, indent=4)
    with open(os.path.join(destination, "config.json"), "w", encoding="utf-8") as f:
        json.dump({**config, "quantization_config": quantization_config}, f, indent=4)
