"""Python side of the kernels: packing, scale views, path choice, and the call.

Math (both paths)::

    y[m, n] = sum_kb s[kb, n // group_n] * sum_{k in block kb} x[m, k] * w[n, k]   (+ bias[n])

with ``x`` bf16, ``w`` an E4M3 (or bf16) element, products and sums in fp32, one multiply per
K block. Imports torch and builds the extension on first call: only linear methods import
this module, never discovery.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kernelbay_cpu_amx._build import load_extension

if TYPE_CHECKING:
    from types import ModuleType

__all__ = [
    "AMX_MIN_M",
    "DECODE_MAX_M",
    "TILE_N",
    "PackedLinear",
    "amx_usable",
    "choose_path",
    "conversion",
    "linear",
    "pack_weight",
    "per_tensor_chunk",
    "scale_operand",
    "vbmi_usable",
]

#: Output columns per packed tile (the kernels' N granularity).
TILE_N = 32
#: Rows up to which the decode path (weights streamed and converted in registers, 4 rows per
#: pass) beats the tiled path (each K block converted once into a buffer), per weight
#: conversion. Measured on an AMD EPYC (Zen 5), 2 threads, N, K in {4096, 14336}: with the
#: VBMI tables conversion is cheap enough that re-converting per 4 rows wins up to M ~ 128;
#: the integer conversion loses beyond M ~ 16; bf16 weights need none (tiled ties F.linear).
DECODE_MAX_M = {"vbmi": 128, "int": 16, "bf16": 32}
#: With AMX tiles (which take any M: 32- and 16-row blocks, the rest zero-padded), the tiled
#: path takes every M from here up. Measured on a Xeon (Sapphire Rapids), 2 and 16 threads:
#: below it the decode path's streaming wins; above it AVX512 dot products lose by far.
AMX_MIN_M = {"vbmi": 8, "int": 8, "bf16": 4}
#: K block for per-tensor scales on the tiled path (the scale is constant; any divisor works).
_PER_TENSOR_CHUNKS = (256, 128, 64, 32)


def extension() -> ModuleType:
    """The compiled kernels (built on first use)."""
    return load_extension()


@functools.lru_cache(maxsize=1)
def amx_usable() -> bool:
    """True when this build has AMX code, the CPU reports amx_bf16 + amx_tile and the OS
    granted tile data to this process (``arch_prctl(ARCH_REQ_XCOMP_PERM)``)."""
    ext = extension()
    return bool(ext.amx_compiled()) and bool(ext.amx_request_permission())


@functools.lru_cache(maxsize=1)
def vbmi_usable() -> bool:
    """True when the CPU has avx512vbmi (the table-based E4M3 conversion)."""
    return bool(extension().vbmi_supported())


def conversion(weight: torch.Tensor, conv: str = "auto") -> str:
    """The weight conversion a call uses: ``"bf16"`` (none), ``"vbmi"`` or ``"int"``."""
    if weight.dtype == torch.bfloat16:
        return "bf16"
    if conv == "auto":
        return "vbmi" if vbmi_usable() else "int"
    if conv not in ("vbmi", "int"):
        raise ValueError(f"conv must be 'auto', 'vbmi' or 'int', got {conv!r}")
    return conv


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] E4M3 (``float8_e4m3fn`` or its uint8 bits) or bf16 -> packed [N/32, K/2, 64].

    Per 32-column tile t and pair of K p, two vectors of 16 columns x 2 k, element
    ``2 j + e`` of vector v being ``w[32 t + 16 v + j, 2 p + e]``: the operand layout of
    ``_mm512_dpbf16_ps`` and of AMX B tiles. bf16 stores vector 0 then vector 1. E4M3 (uint8
    bits) interleaves the two vectors per 16 bytes (8 of vector 0, then 8 of vector 1), so
    that the in-lane byte unpacks of one 64-byte load give both vectors in order.
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    n, k = weight.shape
    if n % TILE_N:
        raise ValueError(f"weight [N={n}, K={k}]: N={n} is not a multiple of {TILE_N}")
    if k % 2:
        raise ValueError(f"weight [N={n}, K={k}]: K={k} is not even")
    if weight.dtype == torch.float8_e4m3fn:
        weight = weight.view(torch.uint8)
    elif weight.dtype not in (torch.uint8, torch.bfloat16):
        raise TypeError(f"weight dtype must be float8_e4m3fn, uint8 (E4M3 bits) or bfloat16, "
                        f"got {weight.dtype}")
    tiled = weight.reshape(n // TILE_N, 2, 16, k // 2, 2)  # t, v, j, p, e
    vectors = tiled.permute(0, 3, 1, 2, 4)  # t, p, v, j, e
    if weight.dtype == torch.uint8:
        # [t, p, v, 32] -> [t, p, v, lane 4, 8] -> [t, p, lane, v, 8]
        vectors = vectors.reshape(n // TILE_N, k // 2, 2, 4, 8).permute(0, 1, 3, 2, 4)
    return vectors.reshape(n // TILE_N, k // 2, 64).contiguous()


def per_tensor_chunk(k: int) -> int:
    """The K block used on the tiled path for a scale constant along K."""
    for chunk in _PER_TENSOR_CHUNKS:
        if k % chunk == 0:
            return chunk
    raise ValueError(f"K={k} is not a multiple of 32")


def scale_operand(scale: torch.Tensor, group: tuple[int, int] | None) -> torch.Tensor:
    """The stored form of a layer's scale: a 0-d fp32 tensor (per-tensor), or the block grid
    [ceil(N/bn), K/bk] transposed to a contiguous fp32 [K/bk, ceil(N/bn)] (one row per K block,
    as the kernels read it)."""
    scale = scale.detach().to(torch.float32)
    if group is None:
        if scale.numel() != 1:
            raise ValueError(f"a per-tensor scale has one element, got shape {tuple(scale.shape)}")
        return scale.reshape(())
    if scale.dim() != 2:
        raise ValueError(f"a block scale is 2-D [N/bn, K/bk], got shape {tuple(scale.shape)}")
    return scale.t().contiguous()


def choose_path(m: int, kind: str = "vbmi", amx: bool = False) -> str:
    """``"decode"`` or ``"tiled"`` for ``m`` rows, by the tuning table above; ``kind`` is
    ``conversion()``'s answer, ``amx`` whether AMX tiles are usable."""
    if amx and m >= AMX_MIN_M[kind]:
        return "tiled"
    return "decode" if m <= DECODE_MAX_M[kind] else "tiled"


@dataclass
class PackedLinear:
    """One layer's weights in kernel form (made once by ``process_weights_after_loading``).

    ``weight``: packed [N/32, K/2, 64] (``pack_weight``); ``scale``: ``scale_operand``'s form,
    fp32 [K/bk, groups] for block scales or 0-d for a per-tensor scale (``group is None``);
    ``bias``: fp32 [N] or ``None``.
    """

    weight: torch.Tensor
    scale: torch.Tensor
    group: tuple[int, int] | None
    bias: torch.Tensor | None
    n: int
    k: int

    def scale_for(self, path: str) -> tuple[torch.Tensor, int]:
        """The scale view and ``group_n`` one call on ``path`` uses."""
        if self.group is not None:
            return self.scale, self.group[0]
        # Per-tensor: the decode path sums the whole K in one block; the tiled path walks K in
        # chunks that fit its buffer. Both read the same element through a stride-0 view.
        blocks = 1 if path == "decode" else self.k // per_tensor_chunk(self.k)
        return self.scale.reshape(1, 1).expand(blocks, 1), self.n


def linear(packed: PackedLinear, x: torch.Tensor, *, path: str | None = None,
           use_amx: bool | None = None, conv: str = "auto") -> torch.Tensor:
    """``x @ W^T (+ bias)`` for x [..., K] (bf16, or fp32 which is rounded to bf16 first).

    The output has x's dtype (bf16 or fp32) and shape [..., N]. ``path`` and ``use_amx``
    default to the tuned choice; ``conv`` picks the E4M3 conversion (``"auto"``: the VBMI
    tables when the CPU has avx512vbmi, else ``"int"``). Tests force each to check them all.
    """
    if x.shape[-1] != packed.k:
        raise ValueError(f"x has K={x.shape[-1]}, the layer has K={packed.k}")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"x dtype must be bfloat16 or float32, got {x.dtype}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, packed.k)
    out_fp32 = x.dtype == torch.float32
    if x2.dtype != torch.bfloat16:
        x2 = x2.to(torch.bfloat16)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    kind = conversion(packed.weight, conv)
    amx = amx_usable() if use_amx is None else use_amx
    chosen = path or choose_path(x2.shape[0], kind, amx)
    amx = amx and chosen == "tiled"
    scale, group_n = packed.scale_for(chosen)
    out: torch.Tensor = extension().linear(x2, packed.weight, scale, group_n, packed.bias,
                                           out_fp32, chosen, amx,
                                           "auto" if kind == "bf16" else kind)
    return out.reshape(*lead, packed.n)
