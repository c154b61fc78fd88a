"""Quark configs as amd-quark's ``QConfig.to_dict()`` writes them, and tiny Quark MXFP4
checkpoints quantized with the ``kernelbay.formats`` reference."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from kernelbay.formats import quantize_mx
from kernelbay.testing.checkpoints import llama_config, write_checkpoint, write_tiny_llama
from safetensors.torch import load_file


def spec(dtype: str = "fp4", dynamic: bool = False, mode: str | None = "even",
         qscheme: str = "per_group", group_size: int | None = 32,
         scale_format: str | None = "e8m0") -> dict[str, Any]:
    """One tensor spec with every key ``QTensorConfig.to_dict()`` writes."""
    return {"dtype": dtype, "is_dynamic": dynamic, "qscheme": qscheme, "ch_axis": -1,
            "group_size": group_size, "block_size": None, "symmetric": None,
            "round_method": "half_even", "scale_type": "float", "zero_point_type": "int32",
            "scale_format": scale_format, "scale_calculation_mode": mode,
            "mx_element_dtype": None, "observer_cls": "PerBlockMXObserver",
            "is_scale_quant": False, "enable_buffer_reuse": False,
            "max_input_numel": 4194304}


def layer(weight: dict[str, Any] | None = None, inputs: dict[str, Any] | None = None,
          output: dict[str, Any] | None = None) -> dict[str, Any]:
    """One layer config as ``QLayerConfig.to_dict()`` writes it."""
    return {"input_tensors": inputs, "output_tensors": output, "weight": weight, "bias": None,
            "target_device": None}


W_MXFP4 = spec("fp4")
A_MXFP4 = spec("fp4", dynamic=True)
A_MXFP8 = spec("fp8_e4m3", dynamic=True)
FP8_TENSOR = spec("fp8_e4m3", qscheme="per_tensor", group_size=None, scale_format="float32",
                  mode=None)


def quark_config(global_layer: dict[str, Any] | None = None,
                 layers: Mapping[str, Any] | None = None,
                 types: Mapping[str, Any] | None = None,
                 exclude: Iterable[str] = ("lm_head",)) -> dict[str, Any]:
    """A whole ``quantization_config`` (default: MXFP4 weights and activations, W4A4)."""
    return {
        "quant_method": "quark",
        "global_quant_config": global_layer or layer(W_MXFP4, A_MXFP4),
        "layer_quant_config": dict(layers or {}),
        "layer_type_quant_config": dict(types or {}),
        "kv_cache_quant_config": {}, "kv_cache_post_rope": False,
        "exclude": list(exclude), "algo_config": None, "softmax_quant_spec": None,
        "quant_mode": "eager_mode", "version": "0.13",
        "export": {"kv_cache_group": [], "min_kv_scale": 0.0, "pack_method": "reorder",
                   "weight_format": "real_quantized", "weight_merge_groups": None},
    }


def write_quark(path: str, config: dict[str, Any], quantized: Callable[[str], bool],
                extra: Mapping[str, torch.Tensor] | None = None) -> str:
    """A tiny Llama with ``quantized(module)`` layers in MXFP4 (even rule, as Quark's default)
    and ``extra`` tensors added; returns ``path``."""
    src = write_tiny_llama(path + "-bf16", seed=3)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in load_file(os.path.join(src, "model.safetensors")).items():
        module = name.removesuffix(".weight")
        if (name.endswith(".weight") and t.dim() == 2 and "embed" not in name
                and quantized(module)):
            tensors[name], tensors[f"{module}.weight_scale"] = quantize_mx(t, "e2m1", "even")
        else:
            tensors[name] = t
    tensors.update(extra or {})
    return write_checkpoint(path, llama_config(quantization_config=config), tensors)
