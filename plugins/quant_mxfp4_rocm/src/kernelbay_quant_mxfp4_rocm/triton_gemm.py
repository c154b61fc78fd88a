# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# (Triton kernels are written in its untyped DSL; the Python wrappers are typed.)
"""Triton MXFP4-weight GEMM: ``y = x @ dequantize_mx(W)^T`` with the weight dequantized in
registers. Imported lazily by the methods (this module imports triton).

Operands: ``w`` packed E2M1 uint8 [N, K/2] (element 2i in the low nibble), ``w_scale`` E8M0
bytes uint8 [N, K/32]; activations ``x`` one of

* bf16 [M, K] (W4A16),
* MXFP4 packed uint8 [M, K/2] + E8M0 bytes [M, K/32] (W4A4, from ``triton_mx.quantize_mx``),
* MXFP8 ``float8_e4m3fn`` [M, K] + E8M0 bytes [M, K/32] (W4A8).

Math: the packing splits K into even and odd elements, so each K tile is two products,
``x[:, 0::2] @ W_lo^T + x[:, 1::2] @ W_hi^T`` (no interleaving in registers). A weight code
``s e1 e0 m`` is placed in an fp16's sign / low exponent / top mantissa bits, which reads as
``e2m1 * 2^-14`` (subnormal codes included), and multiplied by the float32 ``2^(14 + X)``
(scale bytes up to 240, i.e. X <= 113; ``prepare_weight_scales`` checks it once per weight,
byte 255 gives NaN as the reference does). The product is the reference's
``decode_e2m1 * decode_e8m0`` exactly, and exact in bf16 (two significant bits), so the
tensor-core products are exact and accumulate in float32: the result is the reference's
``dequantize_mx`` + float32 matmul up to float32 summation order. MX activations are
decoded the same way (exact in bf16, except E4M3 subnormals of blocks with X < -118, below
bf16's range).

Paths (one kernel, configs differ): M <= 16 runs a 16-row tile over many N tiles with
split-K (partial float32 sums reduced by a second small kernel) for the weight-streaming,
memory-bound case; larger M runs square-ish tiles without split-K.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import triton
import triton.language as tl

if TYPE_CHECKING:
    import torch

__all__ = ["GemmConfig", "candidate_configs", "default_config", "mxfp4_gemm",
           "prepare_weight_scales"]

#: Largest E8M0 weight scale byte the in-register dequantization handles (2^(14 + X) must be
#: a float32: X <= 113).
MAX_WEIGHT_SCALE_BYTE = 240
_A_BF16, _A_MXFP4, _A_MXFP8 = 0, 1, 2


@dataclass(frozen=True)
class GemmConfig:
    """Tile sizes and launch options of one ``mxfp4_gemm`` launch."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    #: Load the weight scales once per 32 columns and broadcast them in registers (fewer,
    #: wider loads; a reshape the compiler lays out) instead of one gather per element.
    scale_bcast: bool = False

    def describe(self) -> str:
        """Compact text, e.g. ``m16n64k256s4w4p4`` (``b`` suffix: ``scale_bcast``)."""
        return (f"m{self.block_m}n{self.block_n}k{self.block_k}s{self.split_k}"
                f"w{self.num_warps}p{self.num_stages}{'b' if self.scale_bcast else ''}")


@triton.jit
def _decode_w(p, s14):
    """Weight nibbles (int32 0..15) times their per-block 2^(14 + X) -> bf16, exact."""
    half = (((p & 8) << 12) | ((p & 7) << 9)).to(tl.int16).to(tl.float16, bitcast=True)
    return (half.to(tl.float32) * s14).to(tl.bfloat16)


@triton.jit
def _weight_multiplier(b):
    """E8M0 weight bytes (int32, at most 240 or 255) -> 2^(14 + X) as float32; 255: NaN."""
    return tl.where(b == 255, 0x7FC00000, (b + 14) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _scale_pow2(b):
    """E8M0 bytes (int32) -> 2^(b - 127) as float32 (b = 0: the subnormal 2^-127; 255: NaN)."""
    v = tl.where(b == 0, 0x00400000, b << 23).to(tl.float32, bitcast=True)
    return tl.where(b == 255, float("nan"), v)


@triton.jit
def _decode_a_e2m1(p, sx):
    """Activation nibbles times 2^X (float32 ``sx``) -> bf16 (exact: 2 significant bits)."""
    half = (((p & 8) << 12) | ((p & 7) << 9)).to(tl.int16).to(tl.float16, bitcast=True)
    return (half.to(tl.float32) * 16384.0 * sx).to(tl.bfloat16)


@triton.jit
def _decode_a_e4m3(b, sx):
    """E4M3 bytes (int32) times 2^X -> bf16: fp16 bits read as e4m3 * 2^-8, NaN kept."""
    half = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.int16).to(tl.float16, bitcast=True)
    v = half.to(tl.float32) * 256.0 * sx
    return tl.where((b & 0x7F) == 0x7F, float("nan"), v).to(tl.bfloat16)


@triton.jit
def _bf16_bits_rne(v):
    """float32 -> bf16 bits (int16), round to nearest even, NaN kept quiet: what a GPU's
    conversion does; the interpreter's conversion truncates, so it stores these bits."""
    bits = v.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(v != v, (bits >> 16) | 0x40, rounded).to(tl.int16)


@triton.jit
def _mxfp4_gemm_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, M, N, K,
                       stride_am, stride_asm, stride_wn, stride_wsn, stride_om, stride_os,
                       A_KIND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
                       INTERPRET: tl.constexpr, OUT_BF16_BITS: tl.constexpr,
                       SCALE_BCAST: tl.constexpr):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    grid_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // grid_n
    pid_n = pid % grid_n
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rh = tl.arange(0, BLOCK_K // 2)
    m_ok = rm < M
    n_ok = rn < N
    rm64 = rm.to(tl.int64)
    rn64 = rn.to(tl.int64)
    k_span = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_span
    k_hi = tl.minimum(k_lo + k_span, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kh = k0 // 2 + rh  # packed column / pair index
        if EVEN_K:
            a_mask = m_ok[:, None]
            w_mask = n_ok[None, :]
        else:
            kh_ok = kh < K // 2
            a_mask = m_ok[:, None] & kh_ok[None, :]
            w_mask = n_ok[None, :] & kh_ok[:, None]
        pw = tl.load(w_ptr + rn64[None, :] * stride_wn + kh[:, None], mask=w_mask,
                     other=0).to(tl.int32)
        if SCALE_BCAST:  # one 2^(14 + X) per 32 columns, broadcast to the 16 bytes
            kb = k0 // 32 + tl.arange(0, BLOCK_K // 32)
            sb = tl.load(ws_ptr + rn64[None, :] * stride_wsn + kb[:, None],
                         mask=n_ok[None, :] & (kb[:, None] < K // 32), other=0).to(tl.int32)
            sf = _weight_multiplier(sb)
            s14 = tl.reshape(tl.broadcast_to(sf[:, None, :], (BLOCK_K // 32, 16, BLOCK_N)),
                             (BLOCK_K // 2, BLOCK_N))
        else:
            bw = tl.load(ws_ptr + rn64[None, :] * stride_wsn + (kh // 16)[:, None],
                         mask=w_mask, other=0).to(tl.int32)
            s14 = _weight_multiplier(bw)
        w_lo = _decode_w(pw & 15, s14)
        w_hi = _decode_w(pw >> 4, s14)
        if A_KIND == 0:
            a_row = a_ptr + rm64[:, None] * stride_am + 2 * kh[None, :]
            x_ev = tl.load(a_row, mask=a_mask, other=0.0).to(tl.bfloat16)
            x_od = tl.load(a_row + 1, mask=a_mask, other=0.0).to(tl.bfloat16)
        else:
            ba = tl.load(as_ptr + rm64[:, None] * stride_asm + (kh // 16)[None, :], mask=a_mask,
                         other=127).to(tl.int32)
            sx = _scale_pow2(ba)
            if A_KIND == 1:
                pa = tl.load(a_ptr + rm64[:, None] * stride_am + kh[None, :], mask=a_mask,
                             other=0).to(tl.int32)
                x_ev = _decode_a_e2m1(pa & 15, sx)
                x_od = _decode_a_e2m1(pa >> 4, sx)
            else:
                a_row = a_ptr + rm64[:, None] * stride_am + 2 * kh[None, :]
                x_ev = _decode_a_e4m3(tl.load(a_row, mask=a_mask, other=0).to(tl.int32), sx)
                x_od = _decode_a_e4m3(tl.load(a_row + 1, mask=a_mask, other=0).to(tl.int32), sx)
        if INTERPRET:  # the interpreter's bf16 dot is wrong; the values are exact in both
            acc = tl.dot(x_ev.to(tl.float32), w_lo.to(tl.float32), acc)
            acc = tl.dot(x_od.to(tl.float32), w_hi.to(tl.float32), acc)
        else:
            acc = tl.dot(x_ev, w_lo, acc)
            acc = tl.dot(x_od, w_hi, acc)
    o_ptr = out_ptr + pid_k.to(tl.int64) * stride_os + rm64[:, None] * stride_om + rn64[None, :]
    if OUT_BF16_BITS:  # noqa: SIM108 (a constexpr branch, not a runtime select)
        out = _bf16_bits_rne(acc)
    else:
        out = acc.to(out_ptr.dtype.element_ty)
    tl.store(o_ptr, out, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _split_k_reduce_kernel(p_ptr, out_ptr, MN, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
                           OUT_BF16_BITS: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT_K):  # fixed order: deterministic
        acc += tl.load(p_ptr + s * MN + offs, mask=ok, other=0.0)
    if OUT_BF16_BITS:  # noqa: SIM108 (a constexpr branch, not a runtime select)
        out = _bf16_bits_rne(acc)
    else:
        out = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs, out, mask=ok)


def prepare_weight_scales(weight_scale: torch.Tensor, name: str = "weight_scale") -> None:
    """Check once that every finite E8M0 weight scale byte is at most 240 (X <= 113), the
    range the in-register dequantization is exact for; raise ``ValueError`` naming the tensor
    and the byte otherwise (such a weight would hold values above 2^114)."""
    import torch

    if weight_scale.dtype != torch.uint8:
        raise TypeError(f"{name}: want E8M0 bytes as uint8, got {weight_scale.dtype}")
    finite = weight_scale[weight_scale != 255]
    top = int(finite.max()) if finite.numel() else 0
    if top > MAX_WEIGHT_SCALE_BYTE:
        raise ValueError(f"{name}: E8M0 byte {top} (scale 2^{top - 127}) is above "
                         f"{MAX_WEIGHT_SCALE_BYTE}, the largest the Triton MXFP4 GEMM "
                         "dequantizes exactly")


def _pow2_floor(v: int) -> int:
    return 1 << (max(v, 1).bit_length() - 1)


def default_config(m: int, n: int, k: int, sm_count: int = 132) -> GemmConfig:
    """The config used when none is given: a 16-row split-K tile for M <= 16 (enough
    programs for two per SM), 64x64 tiles up to M = 64, 128x128 beyond."""
    if m <= 16:
        block_k = 256 if k % 256 == 0 else (128 if k % 128 == 0 else 64 if k % 64 == 0 else 32)
        tiles = triton.cdiv(n, 64)
        split = _pow2_floor(max(1, (2 * sm_count) // max(tiles, 1)))
        split = min(split, max(1, k // (block_k * 4)))
        return GemmConfig(16, 64, block_k, split, 4, 4)
    if m <= 64:
        return GemmConfig(64, 64, 128 if k % 128 == 0 else 32, 1, 4, 3)
    return GemmConfig(128, 128, 64 if k % 64 == 0 else 32, 1, 8, 3)


def candidate_configs(m: int, n: int, k: int) -> list[GemmConfig]:
    """Configs a tuning run tries for one shape (each valid for it: BLOCK_K divides K and
    every split gets at least two K tiles): about 36 for M <= 16, 12 beyond."""
    out: list[GemmConfig] = []
    if m <= 16:
        for bn in (32, 64, 128):
            for bk in (256, 512):
                for split in (1, 2, 4):
                    if k % bk == 0 and k // (bk * split) >= 2:
                        out.append(GemmConfig(16, bn, bk, split, 4, 4))
                        out.append(GemmConfig(16, bn, bk, split, 4, 4, scale_bcast=True))
        return out
    for bm in (64, 128):
        for bn in (64, 128):
            for bk in (64, 128):
                if k % bk:
                    continue
                out.append(GemmConfig(bm, bn, bk, 1, 4, 3))
                if bm == 128:
                    out.append(GemmConfig(bm, bn, bk, 1, 8, 3))
    return out


def mxfp4_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, *,
               x_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
               config: GemmConfig | None = None) -> torch.Tensor:
    """``x @ dequantize_mx(weight, weight_scale, "e2m1")^T`` for 2-D ``x`` (see the module
    comment for the three activation kinds; ``x_scale`` given means MX activations).

    Output [M, N] in ``out_dtype`` (default: bf16, or ``x``'s dtype when that is bf16/fp32).
    """
    import torch

    if weight.dtype != torch.uint8 or weight.dim() != 2:
        raise ValueError(f"mxfp4_gemm: weight must be packed E2M1 uint8 [N, K/2], got "
                         f"{weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape[0], weight.shape[1] * 2
    if k % 32 or tuple(weight_scale.shape) != (n, k // 32) or weight_scale.dtype != torch.uint8:
        raise ValueError(f"mxfp4_gemm: weight_scale must be uint8 [{n}, {k // 32}] and K={k} a "
                         f"multiple of 32, got {weight_scale.dtype} {tuple(weight_scale.shape)}")
    if x_scale is None:
        kind, want_k = _A_BF16, k
        if x.dtype != torch.bfloat16:
            raise ValueError(f"mxfp4_gemm: activations must be bfloat16 (or MX with x_scale), "
                             f"got {x.dtype}")
    elif x.dtype == torch.uint8:
        kind, want_k = _A_MXFP4, k // 2
    elif x.dtype == torch.float8_e4m3fn:
        kind, want_k = _A_MXFP8, k
        x = x.view(torch.uint8)
    else:
        raise ValueError(f"mxfp4_gemm: MX activations must be packed E2M1 uint8 or "
                         f"float8_e4m3fn, got {x.dtype}")
    if x.dim() != 2 or x.shape[1] != want_k:
        raise ValueError(f"mxfp4_gemm: activations must be 2-D with {want_k} columns for "
                         f"K={k}, got {tuple(x.shape)}")
    m = x.shape[0]
    if x_scale is not None and tuple(x_scale.shape) != (m, k // 32):
        raise ValueError(f"mxfp4_gemm: x_scale must be uint8 [{m}, {k // 32}], got "
                         f"{tuple(x_scale.shape)}")
    if out_dtype is None:
        out_dtype = torch.bfloat16
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    weight_scale = weight_scale if weight_scale.stride(-1) == 1 else weight_scale.contiguous()
    xs = weight_scale if x_scale is None else x_scale.contiguous()
    cfg = config or default_config(m, n, k)
    if k % 32 or cfg.block_k % 32 or cfg.block_k < 32:
        raise ValueError(f"mxfp4_gemm: block_k={cfg.block_k} must be a multiple of 32")
    split = max(1, min(cfg.split_k, triton.cdiv(k, cfg.block_k)))
    target = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32,
                                                device=x.device)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), split)
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    out_bits = interpret and split == 1 and out_dtype == torch.bfloat16
    if out_bits:
        target = out.view(torch.int16)
    _mxfp4_gemm_kernel[grid](
        x, xs, weight, weight_scale, target, m, n, k,
        x.stride(0), xs.stride(0), weight.stride(0), weight_scale.stride(0),
        n, m * n if split > 1 else 0,
        A_KIND=kind, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SPLIT_K=split, EVEN_K=k % (cfg.block_k * split) == 0,
        INTERPRET=interpret, OUT_BF16_BITS=out_bits, SCALE_BCAST=cfg.scale_bcast,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split > 1:
        block = 1024
        bits = interpret and out_dtype == torch.bfloat16
        _split_k_reduce_kernel[(triton.cdiv(m * n, block),)](
            target, out.view(torch.int16) if bits else out, m * n, SPLIT_K=split, BLOCK=block,
            OUT_BF16_BITS=bits)
    return out


def config_dict(config: GemmConfig) -> dict[str, int]:
    """The config as a plain dict (for benchmark records)."""
    return asdict(config)
