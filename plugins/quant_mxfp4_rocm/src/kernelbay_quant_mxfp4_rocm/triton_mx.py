# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# (Triton kernels are written in its untyped DSL; the Python wrappers are typed.)
"""Triton kernels for dynamic OCP MX quantization: ``quantize_mx`` (MXFP4 / MXFP8 activations
per block of 32) and the fused ``swiglu_quantize_mx`` (``silu(gate) * up``, then the same
quantizer). Imported lazily by the methods (this module imports triton).

Both reproduce ``kernelbay.formats.mx.quantize_mx`` bit for bit, with the same integer
reading of the block maximum that the reference describes (``frexp`` of a float32 is its
exponent field and mantissa bits)::

    amax = max |x| over the block (float32); a = max(amax, 2^-126) -> fields E, mant
    floor  X = E - 127 - emax
    even   X = E - 127 - emax + (mant >= 2^23 - 2^(22 - m))     significand rounds up to 2
    rceil  X = E - 127 - emax + (mant > frac(max_elem))          ceil(log2(a / max_elem))
    Inf -> X = 127; X clamped to [-127, 127]; byte = X + 127; a NaN block gets byte 255

``frac(max_elem)`` is the mantissa field of 6 = 1.5 * 2^2 (0x400000) or 448 = 1.75 * 2^8
(0x600000): ``a / max_elem`` exceeds a power of two exactly when ``a``'s significand exceeds
the element maximum's. Elements are ``x * 2^-X`` (exact, correctly rounded like the
reference's division by a power of two), then E2M1 by counting midpoints passed (ties to
even, as ``e2m1.encode_e2m1``) or E4M3 by integer round-to-nearest-even after clamping to
±448 (as ``e4m3.to_e4m3``). NaN: E2M1 elements of a NaN block are code 7 (the reference's);
E4M3 elements of a NaN block are the NaN byte 0x7F (the reference keeps the sign of its
NaN, which is not specified; either way the block reads back as NaN).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import triton
import triton.language as tl

if TYPE_CHECKING:
    import torch

__all__ = ["RULE_CODES", "quantize_mx", "swiglu_quantize_mx"]

#: The scale rules of ``kernelbay.formats.mx`` and their kernel codes.
RULE_CODES: dict[str, int] = {"floor": 0, "even": 1, "rceil": 2}
_ELEMS = ("e2m1", "e4m3")
_BLOCK = 32


@triton.jit
def _block_exponent(amax, has_nan, EMAX: tl.constexpr, EVEN_T: tl.constexpr,
                    RCEIL_T: tl.constexpr, RULE: tl.constexpr):
    """Scale bytes (int32, 0..255) and the element multipliers 2^-X (float32) of blocks.

    E2M1: EMAX 2, EVEN_T 0x600000 (2^23 - 2^21, m = 1), RCEIL_T 0x400000 (6 = 1.5 * 2^2);
    E4M3: EMAX 8, EVEN_T 0x780000 (2^23 - 2^19, m = 3), RCEIL_T 0x600000 (448 = 1.75 * 2^8).
    """
    bits = amax.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    e = bits >> 23
    mant = bits & 0x7FFFFF
    tiny = e == 0  # zero or an fp32 subnormal: read as 2^-126
    e = tl.where(tiny, 1, e)
    mant = tl.where(tiny, 0, mant)
    x = e - 127 - EMAX
    if RULE == 1:
        x += (mant >= EVEN_T).to(tl.int32)
    elif RULE == 2:
        x += (mant > RCEIL_T).to(tl.int32)
    x = tl.where(e == 255, 127, x)  # +Inf
    x = tl.minimum(tl.maximum(x, -127), 127)
    byte = tl.where(has_nan, 255, x + 127)
    # 2^-X as float32 bits; X = 127 needs the subnormal 2^-127
    inv_bits = tl.where(x == 127, 0x00400000, (127 - x) << 23)
    inv = inv_bits.to(tl.float32, bitcast=True)
    inv = tl.where(has_nan, float("nan"), inv)
    return byte, inv


@triton.jit
def _encode_e2m1(y):
    """E2M1 codes (int32 0..15) of float32 ``y``: ties to even, saturating, NaN -> 7."""
    mag = tl.abs(y)
    code = (mag > 0.25).to(tl.int32) + (mag >= 0.75).to(tl.int32)
    code += (mag > 1.25).to(tl.int32) + (mag >= 1.75).to(tl.int32)
    code += (mag > 2.5).to(tl.int32) + (mag >= 3.5).to(tl.int32)
    code += (mag > 5.0).to(tl.int32)
    sign = (y.to(tl.int32, bitcast=True) >> 31) & 1
    code = code | (sign << 3)
    return tl.where(y != y, 7, code)


@triton.jit
def _encode_e4m3(y):
    """E4M3 (``float8_e4m3fn``) bytes (int32 0..255) of float32 ``y``: clamp to ±448, round
    to nearest even (subnormals: multiples of 2^-9), NaN -> 0x7F."""
    yc = tl.minimum(tl.maximum(y, -448.0), 448.0)
    bits = yc.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    a = bits & 0x7FFFFFFF
    e = a >> 23
    m = (a & 0x7FFFFF) | 0x800000
    # quantum: 2^(E-130) for E4M3 normals (E >= 121), 2^-9 below; m * 2^(E-150) = value
    s = tl.minimum(tl.maximum(141 - e, 20), 31)
    q = m >> s
    rem = m & ((1 << s) - 1)
    half = 1 << (s - 1)
    up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    q = q + up.to(tl.int32)
    code = tl.where(e >= 121, (e - 120) * 8 + q - 8, q)
    code = tl.where(e == 0, 0, code)
    code = code | (sign << 7)
    return tl.where(y != y, 0x7F, code)


@triton.jit
def _quantize_blocks_e2m1(ev, od, out_ptr, row, blk, j, bmask, RULE: tl.constexpr):
    """Quantize blocks given as even/odd halves [B, 16]; store packed bytes and scales."""
    amax = tl.maximum(tl.max(tl.abs(ev), axis=1), tl.max(tl.abs(od), axis=1))
    has_nan = (tl.max((ev != ev).to(tl.int32), axis=1)
               + tl.max((od != od).to(tl.int32), axis=1)) > 0
    byte, inv = _block_exponent(amax, has_nan, 2, 0x600000, 0x400000, RULE)
    lo = _encode_e2m1(ev * inv[:, None])
    hi = _encode_e2m1(od * inv[:, None])
    packed = (lo | (hi << 4)).to(tl.uint8)
    mask2 = bmask[:, None] & (j[None, :] < 16)
    tl.store(out_ptr + row + blk[:, None] * 16 + j[None, :], packed, mask=mask2)
    return byte


@triton.jit
def _quantize_blocks_e4m3(v, out_ptr, row, blk, j, bmask, RULE: tl.constexpr):
    """Quantize blocks [B, 32]; store E4M3 bytes; return the scale bytes."""
    amax = tl.max(tl.abs(v), axis=1)
    has_nan = tl.max((v != v).to(tl.int32), axis=1) > 0
    byte, inv = _block_exponent(amax, has_nan, 8, 0x780000, 0x600000, RULE)
    code = _encode_e4m3(v * inv[:, None]).to(tl.uint8)
    mask2 = bmask[:, None] & (j[None, :] < 32)
    tl.store(out_ptr + row + blk[:, None] * 32 + j[None, :], code, mask=mask2)
    return byte


@triton.jit
def _load_f32(ptrs, mask, BF16_BITS: tl.constexpr):
    """Load as float32; bf16 given as its int16 bits widens by a shift (exact for subnormals,
    which the interpreter's bf16 conversion flushes)."""
    if BF16_BITS:
        bits = tl.load(ptrs, mask=mask, other=0).to(tl.int32) << 16
        return bits.to(tl.float32, bitcast=True)
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _mx_quant_kernel(x_ptr, out_ptr, scale_ptr, n_blocks, stride_x,
                     IS_E2M1: tl.constexpr, RULE: tl.constexpr, BLOCKS: tl.constexpr,
                     BF16_BITS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    bmask = blk < n_blocks
    x_row = x_ptr + row * stride_x
    if IS_E2M1:
        j = tl.arange(0, 16)
        offs = blk[:, None] * 32 + 2 * j[None, :]
        m2 = bmask[:, None] & (j[None, :] < 16)
        ev = _load_f32(x_row + offs, m2, BF16_BITS)
        od = _load_f32(x_row + offs + 1, m2, BF16_BITS)
        byte = _quantize_blocks_e2m1(ev, od, out_ptr, row * n_blocks * 16, blk, j, bmask,
                                     RULE)
    else:
        j = tl.arange(0, 32)
        m2 = bmask[:, None] & (j[None, :] < 32)
        v = _load_f32(x_row + blk[:, None] * 32 + j[None, :], m2, BF16_BITS)
        byte = _quantize_blocks_e4m3(v, out_ptr, row * n_blocks * 32, blk, j, bmask, RULE)
    tl.store(scale_ptr + row * n_blocks + blk, byte.to(tl.uint8), mask=bmask)


@triton.jit
def _silu_mul(g, u):
    """``silu(g) * u`` in float32 as the reference computes it: g / (1 + exp(-g)) * u."""
    return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def _swiglu_quant_kernel(g_ptr, u_ptr, out_ptr, scale_ptr, h_ptr, n_blocks, stride_g, stride_u,
                         IS_E2M1: tl.constexpr, RULE: tl.constexpr, BLOCKS: tl.constexpr,
                         STORE_H: tl.constexpr, BF16_BITS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    bmask = blk < n_blocks
    g_row = g_ptr + row * stride_g
    u_row = u_ptr + row * stride_u
    h_row = h_ptr + row * n_blocks * 32
    if IS_E2M1:
        j = tl.arange(0, 16)
        offs = blk[:, None] * 32 + 2 * j[None, :]
        m2 = bmask[:, None] & (j[None, :] < 16)
        ev = _silu_mul(_load_f32(g_row + offs, m2, BF16_BITS),
                       _load_f32(u_row + offs, m2, BF16_BITS))
        od = _silu_mul(_load_f32(g_row + offs + 1, m2, BF16_BITS),
                       _load_f32(u_row + offs + 1, m2, BF16_BITS))
        if STORE_H:
            tl.store(h_row + offs, ev, mask=m2)
            tl.store(h_row + offs + 1, od, mask=m2)
        byte = _quantize_blocks_e2m1(ev, od, out_ptr, row * n_blocks * 16, blk, j, bmask,
                                     RULE)
    else:
        j = tl.arange(0, 32)
        offs = blk[:, None] * 32 + j[None, :]
        m2 = bmask[:, None] & (j[None, :] < 32)
        v = _silu_mul(_load_f32(g_row + offs, m2, BF16_BITS),
                      _load_f32(u_row + offs, m2, BF16_BITS))
        if STORE_H:
            tl.store(h_row + offs, v, mask=m2)
        byte = _quantize_blocks_e4m3(v, out_ptr, row * n_blocks * 32, blk, j, bmask, RULE)
    tl.store(scale_ptr + row * n_blocks + blk, byte.to(tl.uint8), mask=bmask)


def _check(x: torch.Tensor, name: str, elem: str, rule: str) -> tuple[int, int]:
    if elem not in _ELEMS:
        raise ValueError(f"MX element type {elem!r} is not one of {list(_ELEMS)}")
    if rule not in RULE_CODES:
        raise ValueError(f"MX scale rule {rule!r} is not one of {list(RULE_CODES)}")
    if x.dim() == 0 or x.shape[-1] % _BLOCK or not x.is_floating_point():
        raise ValueError(f"{name}: want a floating tensor [..., K] with K a multiple of "
                         f"{_BLOCK}, got {x.dtype} {tuple(x.shape)}")
    k = x.shape[-1]
    return x.numel() // k if k else 0, k


def _outputs(shape: tuple[int, ...], rows: int, k: int, elem: str,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    width = k // 2 if elem == "e2m1" else k
    data = torch.empty(rows, width, dtype=torch.uint8, device=device)
    scales = torch.empty(rows, k // _BLOCK, dtype=torch.uint8, device=device)
    return data, scales


def _finish(data: torch.Tensor, scales: torch.Tensor, shape: tuple[int, ...],
            elem: str) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    data = data.reshape(*shape[:-1], data.shape[-1])
    if elem == "e4m3":
        data = data.view(torch.float8_e4m3fn)
    return data, scales.reshape(*shape[:-1], scales.shape[-1])


def _as_bits(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """bf16 tensors travel as their int16 bits (see ``_load_f32``)."""
    import torch

    if x.dtype == torch.bfloat16:
        return x.view(torch.int16), True
    return x, False


def _grid_blocks(n_blocks: int) -> int:
    return min(16, int(triton.next_power_of_2(max(n_blocks, 1))))


def quantize_mx(x: torch.Tensor, elem: str = "e2m1", rule: str = "even"
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic OCP MX quantization of ``x [..., K]`` per block of 32 along K, bit-exact with
    ``kernelbay.formats.quantize_mx`` (see the module comment for NaN blocks in E4M3).

    Returns packed E2M1 uint8 ``[..., K/2]`` or ``float8_e4m3fn [..., K]``, and E8M0 bytes
    ``[..., K/32]``. ``rule`` is ``floor``, ``even`` or ``rceil``.
    """
    rows, k = _check(x, "quantize_mx", elem, rule)
    data, scales = _outputs(tuple(x.shape), rows, k, elem, x.device)
    if rows and k:
        x2 = x.reshape(rows, k)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        x2, bf16 = _as_bits(x2)
        n_blocks = k // _BLOCK
        blocks = _grid_blocks(n_blocks)
        _mx_quant_kernel[(rows, triton.cdiv(n_blocks, blocks))](
            x2, data, scales, n_blocks, x2.stride(0), IS_E2M1=elem == "e2m1",
            RULE=RULE_CODES[rule], BLOCKS=blocks, BF16_BITS=bf16)
    return _finish(data, scales, tuple(x.shape), elem)


def swiglu_quantize_mx(gate: torch.Tensor, up: torch.Tensor, elem: str = "e4m3",
                       rule: str = "even", return_h: bool = False
                       ) -> tuple[torch.Tensor, ...]:
    """Fused ``silu(gate) * up`` (float32) then dynamic MX quantization, as
    ``swiglu.swiglu_quantize_mx_reference`` defines it.

    ``gate`` and ``up`` are [..., K] (K a multiple of 32; views with a unit last stride, e.g.
    the two halves of a gate_up product, are read in place). Returns ``(data, scales)`` as
    ``quantize_mx`` does, plus the float32 product ``h`` when ``return_h`` (for tests).
    """
    import torch

    rows, k = _check(gate, "swiglu_quantize_mx", elem, rule)
    if up.shape != gate.shape:
        raise ValueError(f"swiglu_quantize_mx: gate has shape {tuple(gate.shape)} and up "
                         f"{tuple(up.shape)}; they must be equal")
    data, scales = _outputs(tuple(gate.shape), rows, k, elem, gate.device)
    h = torch.empty(rows if return_h else 0, k, dtype=torch.float32, device=gate.device)
    if rows and k:
        g2, u2 = gate.reshape(rows, k), up.reshape(rows, k)
        g2 = g2 if g2.stride(-1) == 1 else g2.contiguous()
        u2 = u2 if u2.stride(-1) == 1 else u2.contiguous()
        if g2.dtype != u2.dtype:
            raise ValueError(f"swiglu_quantize_mx: gate is {g2.dtype} and up {u2.dtype}; "
                             "they must be equal")
        (g2, bf16), (u2, _) = _as_bits(g2), _as_bits(u2)
        n_blocks = k // _BLOCK
        blocks = _grid_blocks(n_blocks)
        _swiglu_quant_kernel[(rows, triton.cdiv(n_blocks, blocks))](
            g2, u2, data, scales, h if return_h else data, n_blocks, g2.stride(0), u2.stride(0),
            IS_E2M1=elem == "e2m1", RULE=RULE_CODES[rule], BLOCKS=blocks, STORE_H=return_h,
            BF16_BITS=bf16)
    out = _finish(data, scales, tuple(gate.shape), elem)
    if return_h:
        return (*out, h.reshape(gate.shape))
    return out
