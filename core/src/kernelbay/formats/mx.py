"""OCP MX block scaling (MXFP4 = E2M1 elements, MXFP8 = E4M3 elements) with E8M0 scales.

Math
----
Blocks of ``block`` (32) consecutive elements along the last dimension share one scale 2^X,
stored as the E8M0 byte X + 127. An element is stored as ``round_elem(x / 2^X)`` (ties to
even, saturating at the element maximum) and read back as ``elem * 2^X``.

The element types: E2M1 has emax 2 (max 6 = 1.5 * 2^2, 1 mantissa bit); E4M3 has emax 8
(max 448 = 1.75 * 2^8, 3 mantissa bits). For a block with maximum magnitude ``amax``:

    "floor"  X = floor(log2(amax)) - emax                 OCP spec; clips: amax / 2^X can
                                                          reach 8 (E2M1) or 512 (E4M3)
    "even"   X = floor(log2(round_m(amax))) - emax        Quark's "even"; round_m rounds the
                                                          significand half-up to m mantissa
                                                          bits (m = 1 for E2M1, 3 for E4M3)
    "rceil"  X = ceil(log2(amax / max_elem))              never clips (amax / 2^X <= max);
                                                          the default

All three read exponents in one place, from ``frexp`` in float64: ``amax = f * 2^e`` with
``f`` in [0.5, 1), so ``floor(log2(amax)) = e - 1``; the significand ``2f`` rounds up to 2
under round_m exactly when ``f >= 1 - 2^-(m + 2)``; and for "rceil" the ratio
``amax / max_elem`` is formed first (exponent of a ratio, not a ratio of exponents:
``floor(log2(a / b)) != floor(log2(a)) - floor(log2(b))``), then
``ceil(log2(r)) = e - 1 + (f > 0.5)``. The float64 quotient is exact enough: ``amax`` has a
24-bit significand and max_elem 2 or 3 bits, so no quotient lies within 2^-53 of a power of
two without being one.

Guards: ``amax = 0`` (and fp32 subnormals) use the smallest fp32 normal 2^-126 instead, which
already clamps to X = -127; X is clamped to [-127, 127] (bytes [0, 254]). ``amax = +Inf``
gives X = 127: the Inf element saturates and reads back as max_elem * 2^127, which overflows
float32 to Inf again. A block that contains NaN gets the NaN scale byte 255, so it
dequantizes to NaN.

Ragged K (not a multiple of the block) is an error: exporters pad K with zeros up to a
multiple of the block before quantizing, and loaders slice the padding off.

E2M1 data is returned packed (two codes per byte, ``e2m1.pack_e2m1``), as checkpoints store
it; E4M3 data as ``torch.float8_e4m3fn``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

from kernelbay.formats.e2m1 import decode_e2m1, encode_e2m1, pack_e2m1, unpack_e2m1
from kernelbay.formats.e4m3 import to_e4m3
from kernelbay.formats.e8m0 import E8M0_NAN, decode_e8m0, encode_e8m0

__all__ = [
    "MX_BLOCK",
    "MXElem",
    "ScaleRule",
    "dequantize_mx",
    "mx_block_exponent",
    "quantize_mx",
]

MXElem = Literal["e2m1", "e4m3"]
ScaleRule = Literal["floor", "even", "rceil"]

MX_BLOCK = 32
"""The OCP MX block size along the last dimension."""


@dataclass(frozen=True)
class _Elem:
    emax: int
    max: float
    mbits: int


_ELEMS: dict[str, _Elem] = {
    "e2m1": _Elem(emax=2, max=6.0, mbits=1),
    "e4m3": _Elem(emax=8, max=448.0, mbits=3),
}
_F32_MIN_NORMAL = 2.0**-126


def _elem(elem: str) -> _Elem:
    if elem not in _ELEMS:
        raise ValueError(f"MX element type {elem!r} is not one of {sorted(_ELEMS)}")
    return _ELEMS[elem]


def mx_block_exponent(amax: Tensor, elem: MXElem, rule: ScaleRule = "rceil") -> Tensor:
    """The unbiased block exponent X (int32, clamped to [-127, 127]) for block maxima ``amax``.

    ``rule`` is ``"floor"``, ``"even"`` or ``"rceil"`` (see the module comment). ``amax = 0``
    uses the smallest fp32 normal; ``+Inf`` and NaN give 127 (``quantize_mx`` writes the NaN
    byte for NaN blocks).
    """
    spec = _elem(elem)
    if rule not in get_args(ScaleRule):
        raise ValueError(f"MX scale rule {rule!r} is not one of {list(get_args(ScaleRule))}")
    a = amax.double().clamp(min=_F32_MIN_NORMAL)
    if rule == "rceil":
        a = a / spec.max
    f, e = torch.frexp(a)  # a = f * 2^e, f in [0.5, 1)
    floor_log2 = e.long() - 1
    if rule == "floor":
        x = floor_log2 - spec.emax
    elif rule == "even":
        carries = f >= 1.0 - 2.0 ** -(spec.mbits + 2)
        x = floor_log2 + carries.long() - spec.emax
    else:
        x = floor_log2 + (f > 0.5).long()
    x = torch.where(torch.isfinite(a), x, 127)
    return x.clamp(-127, 127).to(torch.int32)


def _check_blocks(k: int, block: int, who: str) -> None:
    if block <= 0 or k % block:
        raise ValueError(
            f"{who}: the last dimension K={k} is not a multiple of the block size {block}; "
            f"exporters pad K with zeros to a multiple of {block} before quantizing"
        )


def quantize_mx(
    x: Tensor, elem: MXElem, rule: ScaleRule = "rceil", block: int = MX_BLOCK
) -> tuple[Tensor, Tensor]:
    """Quantize ``x [..., K]`` to OCP MX blocks along the last dimension.

    Returns ``(data, scales)``: for ``"e2m1"`` the packed codes uint8 ``[..., K/2]``, for
    ``"e4m3"`` ``float8_e4m3fn [..., K]``; the E8M0 scale bytes uint8 ``[..., K/block]``.
    K must be a multiple of ``block``.
    """
    if not x.is_floating_point() or x.dim() == 0:
        raise ValueError(f"quantize_mx wants a floating tensor [..., K], got {x.dtype} {x.shape}")
    k = x.shape[-1]
    _check_blocks(k, block, "quantize_mx")
    xb = x.float().reshape(*x.shape[:-1], k // block, block)
    amax = xb.abs().amax(dim=-1)
    scales = encode_e8m0(mx_block_exponent(amax, elem, rule))
    scales = torch.where(torch.isnan(amax), E8M0_NAN, scales).to(torch.uint8)
    y = (xb / decode_e8m0(scales).unsqueeze(-1)).reshape(x.shape)
    if elem == "e2m1":
        return pack_e2m1(encode_e2m1(y)), scales
    return to_e4m3(y), scales


def dequantize_mx(
    data: Tensor,
    scales: Tensor,
    elem: MXElem,
    block: int = MX_BLOCK,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Dequantize ``quantize_mx`` output: ``elem * 2^X`` per block, computed in float32.

    ``data`` is packed E2M1 uint8 ``[..., K/2]`` or ``float8_e4m3fn [..., K]``; ``scales`` are
    E8M0 bytes ``[..., K/block]``. Returns ``[..., K]`` in ``dtype``.
    """
    _elem(elem)
    if elem == "e2m1":
        values = decode_e2m1(unpack_e2m1(data))
    else:
        if data.dtype != torch.float8_e4m3fn:
            raise TypeError(f"dequantize_mx: e4m3 data must be float8_e4m3fn, got {data.dtype}")
        values = data.float()
    k = values.shape[-1]
    _check_blocks(k, block, "dequantize_mx")
    want = (*values.shape[:-1], k // block)
    if tuple(scales.shape) != want:
        raise ValueError(f"dequantize_mx: scales have shape {tuple(scales.shape)}, want {want}")
    vb = values.reshape(*want, block) * decode_e8m0(scales).unsqueeze(-1)
    return vb.reshape(values.shape).to(dtype)
