"""``fp8-pb-wo-triton``: ModelOpt ``FP8_PB_WO`` layers (E4M3 weight, one fp32 scale per
128 x 128 tile, bf16/fp16 activations) on GPUs through a Triton kernel.

When N or K is not a multiple of 128, ``process_weights_after_loading`` pads the weight with
zeros to whole tiles (the scale grid already covers the partial tiles); ``apply`` masks the
activation's missing K columns and returns exactly N columns. Nothing outside the method sees
the padding: ``tensor_specs`` asks for the checkpoint's shapes, ``apply`` returns [..., N],
``dequantized_weight`` returns [N, K].

Selection: GPU only (CUDA compute capability >= 8.0, ROCm). On CPUs the core's
``torch-fp8-dequant`` (priority 0) or cpu_amx's ``cpu-fp8-avx512`` (priority 50, AVX512-BF16
CPUs, K a multiple of the K block) serve these layers, unchanged by this plugin.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar, cast

from kernelbay.layers.linear import LinearMethod, TensorSpec
from kernelbay.requests import LinearRequest
from kernelbay.verdict import Verdict

from kernelbay_quant_nvfp4.linear_triton import gpu_triton_checks

if TYPE_CHECKING:
    import torch
    from kernelbay.device import DeviceCapability

__all__ = ["Fp8BlockTritonLinear", "pad_fp8_block"]

TILE = 128
_ACT_DTYPES = ("bfloat16", "float16")


def pad_fp8_block(weight: torch.Tensor, tile: int = TILE) -> torch.Tensor:
    """``weight [N, K]`` (E4M3) zero-padded to whole ``tile`` x ``tile`` tiles."""
    import torch
    import torch.nn.functional as F

    n, k = weight.shape
    pn, pk = -(-n // tile) * tile - n, -(-k // tile) * tile - k
    if not pn and not pk:
        return weight.contiguous()
    bits = F.pad(weight.view(torch.uint8), (0, pk, 0, pn))
    return bits.view(torch.float8_e4m3fn)


class Fp8BlockTritonLinear(LinearMethod):
    """FP8 E4M3 weights with fp32 128x128 tile scales, weight-only, decoded in registers;
    pads to whole tiles internally."""

    name: ClassVar[str] = "fp8-pb-wo-triton"
    api_version: ClassVar[str] = "1.0"
    priority: ClassVar[int] = 30
    summary: ClassVar[str] = ("FP8 per-block (128x128) weight-only Triton kernel, pads ragged "
                              "N/K internally; CUDA cc >= 8.0 / ROCm")

    @classmethod
    def can_implement(cls, request: LinearRequest, device: DeviceCapability) -> Verdict:
        s = request.scheme
        r = request
        group = s.group_shape
        shard = {"column": r.out_features, "row": r.in_features}.get(r.parallel)
        return Verdict.all(
            Verdict.handles(r.num_experts is None,
                            f"handles dense layers only, request stacks {r.num_experts} experts"),
            Verdict.handles(s.name == "fp8-block" and s.weight_dtype == "float8_e4m3fn",
                            f"handles FP8 E4M3 per-block weights only, layer is {s.describe()}"),
            Verdict.check(group == (TILE, TILE),
                          f"needs {TILE}x{TILE} scale tiles, scheme has {group}"),
            Verdict.check(s.activation is None,
                          f"runs weight-only (activation None), scheme has {s.activation!r}"),
            gpu_triton_checks(device),
            Verdict.check(r.activation_dtype in _ACT_DTYPES,
                          f"needs activation dtype in {_ACT_DTYPES}, request has "
                          f"{r.activation_dtype!r}"),
            # A tensor-parallel shard must start on a tile edge to keep its own scale rows.
            Verdict.check(r.tp_size == 1 or shard is None or shard % TILE == 0,
                          f"this rank's {r.parallel}-parallel shard of {shard} is not a "
                          f"multiple of the {TILE} scale tile"),
        )

    def tensor_specs(self) -> Mapping[str, TensorSpec]:
        r = self.request
        n, k = r.out_features, r.in_features
        shard = self.weight_shard_dim
        return {
            "weight": TensorSpec((n, k), "float8_e4m3fn", shard),
            "weight_scale": TensorSpec((-(-n // TILE), -(-k // TILE)), "float32", shard),
            **self.bias_specs(),
        }

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Check the scales and pad the weight to whole 128 x 128 tiles (zeros)."""
        import torch

        weight = cast("torch.Tensor", layer.weight)
        scales = cast("torch.Tensor", layer.weight_scale)
        bad = int((~torch.isfinite(scales.data)).sum())
        if bad:
            raise ValueError(f"{self.name}: weight_scale has {bad} NaN/Inf tile scale(s) of "
                             f"{scales.numel()}")
        layer.weight.data = pad_fp8_block(weight.data)
        layer.weight_scale.data = scales.data.float().contiguous()

    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        from kernelbay_quant_nvfp4.fp8_block_kernels import fp8_block_linear_triton

        k, n = self.request.in_features, self.request.out_features
        lead = x.shape[:-1]
        x2 = x.reshape(-1, k)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        if x2.shape[0] == 0:
            return x.new_empty(*lead, n)
        # Tiles without register spills on sm_90 (bench/nvfp4/registers.py's method):
        # 16x64x128 / 4 warps with split-K for decode, 64x128x64 / 8 warps beyond.
        if x2.shape[0] <= 16:
            tile = {"block_m": 16, "block_n": 64, "block_k": 128, "split_k": 4,
                    "num_warps": 4, "num_stages": 4}
        else:
            tile = {"block_m": 64, "block_n": 128, "block_k": 64, "split_k": 1,
                    "num_warps": 8, "num_stages": 3}
        out = fp8_block_linear_triton(x2, cast("torch.Tensor", layer.weight),
                                      cast("torch.Tensor", layer.weight_scale), n,
                                      self.rank_bias(layer), **tile)
        return out.reshape(*lead, n)

    def dequantized_weight(self, layer: torch.nn.Module) -> torch.Tensor:
        """[N, K] in the activation dtype, through the reference (padding sliced off)."""
        import torch
        from kernelbay.formats import dequantize_fp8_per_block

        n, k = self.request.out_features, self.request.in_features
        w = cast("torch.Tensor", layer.weight)[:n, :k]
        dense = dequantize_fp8_per_block(w, cast("torch.Tensor", layer.weight_scale),
                                         (TILE, TILE))
        return dense.to(getattr(torch, self.request.activation_dtype))
