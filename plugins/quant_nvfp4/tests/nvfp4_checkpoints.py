"""Tiny NVFP4 checkpoints in the ModelOpt and compressed-tensors dialects, quantized with the
``kernelbay.formats`` reference (imported by the tests and by conftest's fixtures)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
from kernelbay.formats import (
    compressed_tensors_global_scale,
    nvfp4_global_scale,
    quantize_fp8_per_block,
    quantize_fp8_per_tensor,
    quantize_nvfp4,
)
from safetensors.torch import load_file

# Layers that read the same input share one global scale in ModelOpt exports.
_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _is_linear(name: str, t: torch.Tensor) -> bool:
    return (name.endswith(".weight") and t.dim() == 2 and "embed" not in name
            and "norm" not in name)


def _shared_globals(bf16: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Module -> the global scale it is quantized with (shared among q/k/v and gate/up)."""
    shared: dict[str, torch.Tensor] = {}
    for name, t in bf16.items():
        if not _is_linear(name, t):
            continue
        module = name[: -len(".weight")]
        parent, leaf = module.rsplit(".", 1) if "." in module else ("", module)
        group = next((g for g in _SIBLINGS if leaf in g), (leaf,))
        names = [f"{parent}.{m}.weight" if parent else f"{m}.weight" for m in group]
        amax = max(float(bf16[n].float().abs().max()) for n in names)
        shared[module] = nvfp4_global_scale(torch.tensor(amax))
    return shared


def quantize_llama(src: str, algo_of: Callable[[str], str | None],
                   dialect: str = "modelopt") -> dict[str, torch.Tensor]:
    """The tensors of the bf16 checkpoint at ``src`` with each linear module quantized as
    ``algo_of(module)`` says (``"NVFP4"``, ``"W4A16_NVFP4"``, ``"FP8"``, ``"FP8_PB_WO"`` or
    None), named as ``dialect`` names them."""
    bf16 = load_file(os.path.join(src, "model.safetensors"))
    globals_ = _shared_globals(bf16)
    out: dict[str, torch.Tensor] = {}
    for name, t in bf16.items():
        module = name[: -len(".weight")]
        algo = algo_of(module) if _is_linear(name, t) else None
        if algo is None:
            out[name] = t
            continue
        if algo in ("NVFP4", "W4A16_NVFP4"):
            packed, scales, g = quantize_nvfp4(t, globals_[module])
            input_scale = nvfp4_global_scale(torch.tensor(3.0))
            if dialect == "modelopt":
                out[f"{module}.weight"] = packed
                out[f"{module}.weight_scale"] = scales
                out[f"{module}.weight_scale_2"] = g
                if algo == "NVFP4":
                    out[f"{module}.input_scale"] = input_scale
            else:
                out[f"{module}.weight_packed"] = packed
                out[f"{module}.weight_scale"] = scales
                out[f"{module}.weight_global_scale"] = compressed_tensors_global_scale(g)[None]
                if algo == "NVFP4":
                    out[f"{module}.input_global_scale"] = (
                        compressed_tensors_global_scale(input_scale)[None])
        elif algo == "FP8":
            q, s = quantize_fp8_per_tensor(t)
            out[f"{module}.weight"], out[f"{module}.weight_scale"] = q, s
            out[f"{module}.input_scale"] = torch.tensor(0.01)
        elif algo == "FP8_PB_WO":
            q, s = quantize_fp8_per_block(t)
            out[f"{module}.weight"], out[f"{module}.weight_scale"] = q, s
        else:
            raise ValueError(f"unknown algo {algo!r}")
    return out


def modelopt_quant(algo: str, exclude: Iterable[str] = ("lm_head",),
                   **extra: Any) -> dict[str, Any]:
    """``hf_quant_config.json``'s ``quantization`` block as ModelOpt writes it."""
    block: dict[str, Any] = {"quant_algo": algo, "kv_cache_quant_algo": None,
                             "exclude_modules": list(exclude)}
    if algo in ("NVFP4", "W4A16_NVFP4"):
        block["group_size"] = 16
    block.update(extra)
    return block


def modelopt_config_json(quant: dict[str, Any]) -> dict[str, Any]:
    """``config.json``'s ``quantization_config`` as recent ModelOpt exports write it: the
    same facts, ``ignore`` instead of ``exclude_modules``, plus a ``config_groups`` block."""
    config = {k: v for k, v in quant.items() if k != "exclude_modules"}
    config.update({
        "quant_method": "modelopt", "ignore": quant.get("exclude_modules", []),
        "producer": {"name": "modelopt", "version": "0.47.0"},
        "config_groups": {"group_0": {
            "input_activations": {"dynamic": False, "num_bits": 4, "type": "float",
                                  "group_size": 16},
            "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
            "targets": ["Linear"]}},
    })
    return config


def ct_config(ignore: Iterable[str] = ("lm_head",), w4a4: bool = True,
              targets: Iterable[str] = ("Linear",)) -> dict[str, Any]:
    """A compressed-tensors NVFP4 ``quantization_config`` as llm-compressor writes it."""
    args = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group",
            "group_size": 16, "dynamic": False, "observer": "minmax", "actorder": None,
            "block_structure": None, "observer_kwargs": {}}
    group = {"targets": list(targets), "weights": args, "output_activations": None,
             "input_activations": {**args, "dynamic": "local"} if w4a4 else None,
             "format": "nvfp4-pack-quantized"}
    return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
            "config_groups": {"group_0": group}, "ignore": list(ignore),
            "kv_cache_scheme": None, "quantization_status": "compressed",
            "global_compression_ratio": None, "sparsity_config": {}, "version": "0.12.2"}
