"""NVFP4: E2M1 elements, E4M3 scales per 16 elements along K, one fp32 scale per tensor.

Math
----
For a weight ``w [..., K]`` (K a multiple of 16), in float32 and in the order of ModelOpt's
``NVFP4QTensor.quantize`` (read from its source), so the bytes should match its exporter:

    global  = amax(|w|) / (6 * 448)                       ModelOpt ``weight_scale_2``
    s_b     = amax_b(|w|) / (6 * global)                  per block b of 16; in (0, 448]
    s_b     = 1.0 where s_b == 0                          zero blocks (as ModelOpt)
    scale_b = e4m3(s_b)                                   ``weight_scale`` (clamped, RNE)
    code    = e2m1(w / (float(scale_b) * global))         packed two per byte
    w'      = e2m1_value(code) * (float(scale_b) * global)

Without the global scale, a block's scale ``amax_b / 6`` would fall below E4M3's smallest
subnormal (2^-9) for small weights and round to zero; with it the largest block uses the top
of E4M3's range. A block whose scale still rounds to zero (``amax_b`` below about
``amax * 2^-10 / 448``) dequantizes to zero whatever its codes; the reference writes code 0
there (ModelOpt divides by zero and writes ±6 codes; the dequantized value is the same).

An all-zero tensor gets ``global = 1.0`` (ModelOpt would produce NaN block scales), so
nothing here is ever NaN for finite input. A NaN or Inf anywhere in ``w`` makes ``global``
non-finite, and the whole tensor dequantizes to NaN.

compressed-tensors (llm-compressor's ``nvfp4-pack-quantized``) stores the reciprocal,
``weight_global_scale = (6 * 448) / amax``, and divides by it when dequantizing.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernelbay.formats.division import divide
from kernelbay.formats.e2m1 import E2M1_MAX, decode_e2m1, encode_e2m1, pack_e2m1, unpack_e2m1
from kernelbay.formats.e4m3 import E4M3_MAX, to_e4m3

__all__ = [
    "NVFP4_BLOCK",
    "compressed_tensors_global_scale",
    "dequantize_nvfp4",
    "nvfp4_global_scale",
    "quantize_nvfp4",
]

NVFP4_BLOCK = 16
"""The NVFP4 block size along K."""


def nvfp4_global_scale(amax: Tensor) -> Tensor:
    """The fp32 per-tensor scale ``amax / (6 * 448)``; 1.0 where that is 0 (all-zero tensor)."""
    g = divide(amax.float(), E2M1_MAX * E4M3_MAX)
    return torch.where(g == 0, 1.0, g)


def compressed_tensors_global_scale(global_scale: Tensor) -> Tensor:
    """Convert between ModelOpt's ``weight_scale_2`` and compressed-tensors' global scale.

    compressed-tensors' ``weight_global_scale`` (and ``input_global_scale``) is the
    reciprocal, ``(6 * 448) / amax``; the conversion is ``1 / x`` both ways. llm-compressor
    computes its value as ``(6 * 448) / amax`` directly, which can differ from ``1 / x`` in
    the last bit.
    """
    return 1.0 / global_scale.float()


def _blocks(x: Tensor, who: str) -> Tensor:
    if x.dim() == 0 or x.shape[-1] % NVFP4_BLOCK:
        k = x.shape[-1] if x.dim() else 0
        raise ValueError(
            f"{who}: the last dimension K={k} is not a multiple of the NVFP4 block "
            f"{NVFP4_BLOCK}; exporters pad K with zeros to a multiple of {NVFP4_BLOCK}"
        )
    return x.reshape(*x.shape[:-1], x.shape[-1] // NVFP4_BLOCK, NVFP4_BLOCK)


def quantize_nvfp4(w: Tensor, global_scale: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Quantize ``w [..., K]`` to NVFP4.

    Returns ``(packed uint8 [..., K/2], block_scales float8_e4m3fn [..., K/16],
    global_scale fp32 [])``. ``global_scale`` defaults to ``nvfp4_global_scale(amax(|w|))``;
    pass one to share it between fused shards or to quantize activations with a static
    ``input_scale``.
    """
    if not w.is_floating_point():
        raise TypeError(f"quantize_nvfp4 wants a floating tensor, got dtype {w.dtype}")
    wb = _blocks(w.float(), "quantize_nvfp4")
    g = nvfp4_global_scale(wb.abs().amax()) if global_scale is None else global_scale.float()
    s = wb.abs().amax(dim=-1) / (E2M1_MAX * g.to(wb.device))
    block_scales = to_e4m3(torch.where(s == 0, 1.0, s))
    scale = (block_scales.float() * g).unsqueeze(-1)
    codes = torch.where(scale == 0, 0, encode_e2m1(wb / scale)).to(torch.uint8)
    return pack_e2m1(codes.reshape(w.shape)), block_scales, g.reshape(())


def dequantize_nvfp4(
    packed: Tensor,
    block_scales: Tensor,
    global_scale: Tensor,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Dequantize NVFP4: ``e2m1_value * (float(block_scale) * global_scale)``, in float32.

    ``packed`` uint8 ``[..., K/2]``, ``block_scales`` float8_e4m3fn ``[..., K/16]``,
    ``global_scale`` fp32 (ModelOpt's ``weight_scale_2``). Returns ``[..., K]`` in ``dtype``.
    """
    if block_scales.dtype != torch.float8_e4m3fn:
        raise TypeError(
            f"dequantize_nvfp4: block scales must be float8_e4m3fn, got {block_scales.dtype}"
        )
    values = _blocks(decode_e2m1(unpack_e2m1(packed)), "dequantize_nvfp4")
    if values.shape[:-1] != block_scales.shape:
        raise ValueError(
            f"dequantize_nvfp4: block scales have shape "
            f"{tuple(block_scales.shape)}, want {tuple(values.shape[:-1])}"
        )
    scale = block_scales.float() * global_scale.float()
    out = values * scale.unsqueeze(-1)
    return out.reshape(*packed.shape[:-1], 2 * packed.shape[-1]).to(dtype)
