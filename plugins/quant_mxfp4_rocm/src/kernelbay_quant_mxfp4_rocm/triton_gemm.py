# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# (Triton kernels are written in its untyped DSL; the Python wrappers are typed.)
"""Triton MXFP4-weight GEMM: ``y = x @ dequantize_mx(W)^T`` with the weight dequantized in
registers. Imported lazily by the methods (this module imports triton).

Operands: ``w`` packed E2M1, either the checkpoint's uint8 [N, K/2] (element 2i in the low
nibble; read as int16 halfwords or int32 words) or the repacked int32 words of
``kernelbay.formats.repack_e2m1_words`` (K order [N, K/8], or fragment order [N, K/32, 4],
which ``prepare_weight`` stores where the PTX decode runs); ``w_scale`` E8M0 bytes uint8
[N, K/32]; activations ``x`` one of

* bf16 [M, K] (W4A16),
* MXFP4 packed uint8 [M, K/2] + E8M0 bytes [M, K/32] (W4A4, from ``triton_mx.quantize_mx``),
* MXFP8 ``float8_e4m3fn`` [M, K] + E8M0 bytes [M, K/32] (W4A8).

Paths (``GemmConfig.path``):

* ``decode``: each K tile of the weight is decoded to exact bf16 by
  ``triton_decode.decode_e2m1`` (two lanes per instruction in PTX on CUDA, plain Triton
  elsewhere; ``KERNELBAY_MXFP4_PLAIN_DECODE=1`` forces the plain one on CUDA, to compare) and fed to one ``tl.dot`` with float32 accumulation; MX activations are
  decoded to bf16 once per call first (``decode_activations``, one small kernel). M <= 16 runs a 16-row tile over many N tiles with split-K
  (float32 partials summed in a fixed order by a second small kernel).
* ``pairs``: as ``decode``, the weight read as 32-bit words and decoded by
  ``triton_decode.decode_e2m1_pairs`` (elements k and k + 4 in one register: fewer
  instructions per element), the tile in ``PAIR_ORDER`` along K and the activation tile
  permuted in registers to match.
* ``repacked``: the repacked words, decoded by ``decode_e2m1_pairs(REPACKED=True)`` in the
  natural K order (most element pairs one mask, or one rotation and one mask; the PTX is the
  scale multiply alone).
* ``fragment``: the repacked words in the ``"fragment"`` K order (int32 [N, K/32, 4],
  what ``prepare_weight`` stores on CUDA), decoded by ``decode_e2m1_fragment`` into the
  registers of the dot's first operand with the product computed transposed (on sm_90 the
  weight is the register operand of the wgmma, the activations its shared-memory operand as
  loaded): the CUDA default at every M.
* ``scaled``: Triton's ``tl.dot_scaled`` (its own MX upcast on GPUs without MX MMA), for
  comparison in the tuning sweep.
* ``dequant``: the whole weight decoded to bf16 once per call (``decode_kernel``), then
  torch's matmul: for large M, where one pass over a bf16 weight costs less than decoding per
  tile.

Exactness: every dequantized weight value has two significant bits, so it is a bf16 exactly
when it is a float32, and the decode reproduces the reference's float32 values bit for bit
(NaN for byte 255); the tensor-core products are exact and accumulate in float32, so the
result is the reference's ``dequantize_mx`` + float32 matmul up to float32 summation order.
MX activations are decoded the same way (exact in bf16, except E4M3 subnormals of blocks with
X < -118, below bf16's range, rounded once as the reference's bf16 conversion does). Nothing
on the GEMM's paths synchronizes with the host, so a call can be captured in a CUDA graph.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import triton
import triton.language as tl
from kernelbay import triton_pdl
from kernelbay.formats.bf16_triton import bf16_bits_rne
from kernelbay.formats.e2m1_words_triton import weight_dot
from kernelbay.triton_pdl import grid_release, grid_wait

from kernelbay_quant_mxfp4_rocm.triton_decode import (
    decode_e2m1,
    decode_e2m1_fragment,
    decode_e2m1_pairs,
    decode_kernel,
)

if TYPE_CHECKING:
    import torch

__all__ = ["LAYOUTS", "GemmConfig", "candidate_configs", "decode_activations", "default_config",
           "dequantize_weight", "layout_weight", "mxfp4_gemm", "prepare_weight",
           "prepare_weight_scales", "weight_layout"]

#: Largest E8M0 weight byte of the single-multiply decode (2^(b - 1) must be a bf16; the NaN
#: byte 255 is above it, so that decode needs no NaN select).
FAST_SCALE_MAX_BYTE = 128
_A_BF16, _A_MXFP4, _A_MXFP8 = 0, 1, 2
PATHS = ("decode", "pairs", "repacked", "fragment", "scaled", "dequant")
#: Weight layouts (``weight_layout``): the checkpoint's uint8 [N, K/2], the repacked words
#: int32 [N, K/8] (K order) and the fragment-order words int32 [N, K/32, 4]
#: (``kernelbay.formats.repack_e2m1_words``; the extra dimension tells the two apart).
LAYOUTS = ("checkpoint", "repacked", "fragment")
#: The paths that read each layout.
READABLE = {"checkpoint": ("decode", "pairs", "scaled", "dequant"),
            "repacked": ("repacked", "dequant"), "fragment": ("fragment", "dequant")}


@dataclass(frozen=True)
class GemmConfig:
    """Tile sizes and launch options of one ``mxfp4_gemm`` launch."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    #: ``decode`` (in-register decode + ``tl.dot``), ``pairs`` (the same from 32-bit words,
    #: K in ``triton_decode.PAIR_ORDER``), ``repacked`` (32-bit words of the repacked layout,
    #: ``kernelbay.formats.repack_e2m1_words``: the weight must be stored so), ``scaled``
    #: (``tl.dot_scaled``) or ``dequant`` (bf16 weight, then torch's matmul).
    path: str = "decode"
    #: Register cap per thread for the compiler (Triton's ``maxnreg``, NVIDIA GPUs only,
    #: 24-255), None for its own choice: a tuning knob (more resident programs per SM, or
    #: spills), in no default.
    max_registers: int | None = None

    def describe(self) -> str:
        """Compact text, e.g. ``m16n64k256s4w4p4`` (suffix ``-scaled`` / ``-dequant``; ``r96``
        before it for a register cap)."""
        tail = "" if self.path == "decode" else f"-{self.path}"
        cap = "" if self.max_registers is None else f"r{self.max_registers}"
        return (f"m{self.block_m}n{self.block_n}k{self.block_k}s{self.split_k}"
                f"w{self.num_warps}p{self.num_stages}{cap}{tail}")

    @classmethod
    def parse(cls, text: str) -> GemmConfig:
        """The config ``describe`` wrote, e.g. ``"m16n64k256s4w4p3r96-fragment"`` (``ValueError``
        naming the text and the form otherwise)."""
        found = re.fullmatch(r"m(\d+)n(\d+)k(\d+)s(\d+)w(\d+)p(\d+)(?:r(\d+))?(?:-(\w+))?",
                             text)
        if not found or (found.group(8) or "decode") not in PATHS:
            raise ValueError(f"mxfp4_gemm config {text!r}; expected m<M>n<N>k<K>s<split>"
                             f"w<warps>p<stages>[r<registers>][-<path>] with a path of "
                             f"{list(PATHS)}, e.g. m16n64k256s4w4p3-fragment")
        bm, bn, bk, split, warps, stages = (int(v) for v in found.groups()[:6])
        cap = found.group(7)
        return cls(bm, bn, bk, split, warps, stages, found.group(8) or "decode",
                   None if cap is None else int(cap))


@triton.jit
def _scale_pow2(b):
    """E8M0 bytes (int32) -> 2^(b - 127) as float32 (b = 0: the subnormal 2^-127; 255: NaN)."""
    v = tl.where(b == 0, 0x00400000, b << 23).to(tl.float32, bitcast=True)
    return tl.where(b == 255, float("nan"), v)


@triton.jit
def _mxfp4_gemm_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, M, N, K,
                       stride_am, stride_asm, stride_wn, stride_wsn, stride_om, stride_os,
                       A_KIND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
                       INTERPRET: tl.constexpr, OUT_BF16_BITS: tl.constexpr,
                       ASM: tl.constexpr, FAST: tl.constexpr, SCALED: tl.constexpr,
                       PAIRS: tl.constexpr, REPACKED: tl.constexpr,
                       CLAMP_ROWS: tl.constexpr, SWAP: tl.constexpr = False,
                       PDL: tl.constexpr = False):
    # w_ptr: int16 halfwords [N, K/4] (decode), int32 words [N, K/8] (PAIRS, REPACKED) or
    # bytes [N, K/2] (SCALED), or the "fragment"-order words [N, K/8] (SWAP: the product is
    # computed transposed, the decoded tile the register operand of the dot); a_ptr: bf16
    # activations, or MX bytes (SCALED only). PDL (kernelbay.triton_pdl): a programmatic
    # launch, which reads and writes nothing before grid_wait and lets the next launch start
    # once its K loop is done.
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    grid_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // grid_n
    pid_n = pid % grid_n
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    KW: tl.constexpr = BLOCK_K // 4
    KS: tl.constexpr = BLOCK_K // 32
    rw = tl.arange(0, KW)
    rs = tl.arange(0, KS)
    rk = tl.arange(0, BLOCK_K)
    rq = tl.arange(0, BLOCK_K // 8)
    rh = tl.arange(0, BLOCK_K // 2)
    m_ok = rm < M
    n_ok = rn < N
    rm64 = rm.to(tl.int64)
    x_rows = tl.minimum(rm, M - 1).to(tl.int64)
    rn64 = rn.to(tl.int64)
    k_span = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_span
    k_hi = tl.minimum(k_lo + k_span, K)
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PDL:
        grid_wait()
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kw = k0 // 4 + rw
        ks = k0 // 32 + rs
        kk = k0 + rk
        kh = k0 // 2 + rh
        if EVEN_K:
            s_ok = n_ok[:, None]
            as_ok = m_ok[:, None]
            w_ok = n_ok[:, None]
            q_ok = n_ok[:, None]
            ak_ok = m_ok[:, None]
            ah_ok = m_ok[:, None]
            wh_ok = n_ok[:, None]
        else:
            s_ok = n_ok[:, None] & (ks[None, :] < K // 32)
            as_ok = m_ok[:, None] & (ks[None, :] < K // 32)
            w_ok = n_ok[:, None] & (kw[None, :] < K // 4)
            q_ok = n_ok[:, None] & ((k0 // 8 + rq)[None, :] < K // 8)
            ak_ok = m_ok[:, None] & (kk[None, :] < K)
            ah_ok = m_ok[:, None] & (kh[None, :] < K // 2)
            wh_ok = n_ok[:, None] & (kh[None, :] < K // 2)
        sb = tl.load(ws_ptr + rn64[:, None] * stride_wsn + ks[None, :], mask=s_ok, other=0)
        if A_KIND != 0:
            xb = tl.load(as_ptr + rm64[:, None] * stride_asm + ks[None, :], mask=as_ok,
                         other=127)
        if SCALED:
            wq = tl.load(w_ptr + rn64[:, None] * stride_wn + kh[None, :], mask=wh_ok, other=0)
            if A_KIND == 0:
                xa = tl.load(a_ptr + rm64[:, None] * stride_am + kk[None, :], mask=ak_ok,
                             other=0.0)
                acc = tl.dot_scaled(xa, None, "bf16", tl.trans(wq), sb, "e2m1", acc=acc)
            elif A_KIND == 1:
                xa = tl.load(a_ptr + rm64[:, None] * stride_am + kh[None, :], mask=ah_ok,
                             other=0)
                acc = tl.dot_scaled(xa, xb, "e2m1", tl.trans(wq), sb, "e2m1", acc=acc)
            else:
                xa = tl.load(a_ptr + rm64[:, None] * stride_am + kk[None, :], mask=ak_ok,
                             other=0).to(tl.float8e4nv, bitcast=True)
                acc = tl.dot_scaled(xa, xb, "e4m3", tl.trans(wq), sb, "e2m1", acc=acc)
        else:
            if SWAP:
                words = tl.load(w_ptr + rn64[:, None] * stride_wn + (k0 // 8 + rq)[None, :],
                                mask=q_ok, other=0)
                w = decode_e2m1_fragment(words, sb.to(tl.int32), BLOCK_N, BLOCK_K // 8, ASM,
                                         FAST)
            elif PAIRS or REPACKED:
                words = tl.load(w_ptr + rn64[:, None] * stride_wn + (k0 // 8 + rq)[None, :],
                                mask=q_ok, other=0)
                w = decode_e2m1_pairs(words, sb.to(tl.int32), BLOCK_N, BLOCK_K // 8, ASM,
                                      FAST, REPACKED)
            else:
                halves = tl.load(w_ptr + rn64[:, None] * stride_wn + kw[None, :], mask=w_ok,
                                 other=0)
                w = decode_e2m1(halves, sb.to(tl.int32), BLOCK_N, KW, ASM, FAST)
            # bf16 activations only: MX ones are decoded once per call (decode_activations)
            # CLAMP_ROWS: rows past M read row M - 1 instead of being masked (their outputs are
            # never stored): no per-row predicates, which cost the 16-row tile 10 registers and
            # a resident program per SM when M is neither 1 nor a multiple of 16 (at M = 1
            # the masked rows cost nothing; clamped they are redundant row loads)
            if CLAMP_ROWS:
                if EVEN_K:
                    xa = tl.load(a_ptr + x_rows[:, None] * stride_am + kk[None, :])
                else:
                    xa = tl.load(a_ptr + x_rows[:, None] * stride_am + kk[None, :],
                                 mask=(kk < K)[None, :], other=0.0)
            else:
                xa = tl.load(a_ptr + rm64[:, None] * stride_am + kk[None, :], mask=ak_ok,
                             other=0.0)
            xa = xa.to(tl.bfloat16)
            if PAIRS:  # the activations in the decoded tile's K order (PAIR_ORDER)
                xa = tl.reshape(tl.permute(tl.reshape(xa, (BLOCK_M, BLOCK_K // 8, 2, 4)),
                                           (0, 1, 3, 2)), (BLOCK_M, BLOCK_K))
            acc = weight_dot(xa, w, acc, SWAP, INTERPRET)
    if PDL:
        grid_release()
    if SWAP:
        acc = tl.trans(acc)
    o_ptr = out_ptr + pid_k.to(tl.int64) * stride_os + rm64[:, None] * stride_om + rn64[None, :]
    if OUT_BF16_BITS:  # noqa: SIM108 (a constexpr branch, not a runtime select)
        out = bf16_bits_rne(acc)
    else:
        out = acc.to(out_ptr.dtype.element_ty)
    tl.store(o_ptr, out, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _split_k_reduce_kernel(p_ptr, out_ptr, MN, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
                           OUT_BF16_BITS: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # the partials are the kernel before's output; the next launch may start now
        grid_wait()
        grid_release()
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT_K):  # fixed order: deterministic
        acc += tl.load(p_ptr + s * MN + offs, mask=ok, other=0.0)
    if OUT_BF16_BITS:  # noqa: SIM108 (a constexpr branch, not a runtime select)
        out = bf16_bits_rne(acc)
    else:
        out = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs, out, mask=ok)


@triton.jit
def _decode_e4m3_kernel(x_ptr, s_ptr, out_ptr, M, K, stride_x, stride_s, stride_o,
                        BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, OUT_BITS: tl.constexpr):
    """MXFP8 activations (E4M3 bytes [M, K], E8M0 bytes [M, K/32]) -> bf16 [M, K]: the
    reference's float32 product (exact) rounded once to bf16; ``OUT_BITS``: int16 bits
    (the interpreter's bf16 conversion truncates)."""
    rr = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    rs = tl.program_id(1) * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)
    ok = rr[:, None] < M
    r64 = rr.to(tl.int64)
    k_ok = ok & (rk[None, :] < K)
    b = tl.load(x_ptr + r64[:, None] * stride_x + rk[None, :], mask=k_ok, other=0)
    sb = tl.load(s_ptr + r64[:, None] * stride_s + rs[None, :],
                 mask=ok & (rs[None, :] < K // 32), other=127).to(tl.int32)
    sx = tl.reshape(tl.broadcast_to(_scale_pow2(sb)[:, :, None], (BLOCK_R, BLOCK_K // 32, 32)),
                    (BLOCK_R, BLOCK_K))
    b = b.to(tl.int32) & 0xFF
    half = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.int16).to(tl.float16, bitcast=True)
    v = tl.where((b & 0x7F) == 0x7F, float("nan"), half.to(tl.float32) * 256.0 * sx)
    o_ptr = out_ptr + r64[:, None] * stride_o + rk[None, :]
    if OUT_BITS:
        tl.store(o_ptr, bf16_bits_rne(v), mask=k_ok)
    else:
        tl.store(o_ptr, v.to(tl.bfloat16), mask=k_ok)


def decode_activations(x: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
    """MX activations as bf16 [M, K], decoded on the device in one pass: packed E2M1 uint8
    [M, K/2] (``dequantize_weight``'s decode, general scale range) or MXFP8 (uint8 or
    ``float8_e4m3fn`` [M, K]) with E8M0 bytes [M, K/32]. Equals the reference's
    ``dequantize_mx(...).to(torch.bfloat16)`` bit for bit (E2M1 products are exact in bf16;
    E4M3 ones are rounded once, as the reference's conversion does); no host sync, so it
    can be captured in a CUDA graph."""
    import torch

    if x.dtype == torch.float8_e4m3fn:
        x = x.view(torch.uint8)
    m, k_cols = x.shape
    if x_scale.dtype != torch.uint8 or x_scale.dim() != 2 or x_scale.shape[0] != m:
        raise ValueError(f"decode_activations: x_scale must be uint8 [{m}, K/32], got "
                         f"{x_scale.dtype} {tuple(x_scale.shape)}")
    if x_scale.shape[1] * 32 == k_cols * 2:  # packed E2M1: [M, K/2]
        return dequantize_weight(x, x_scale, scale_max=None)
    k = k_cols
    if x_scale.shape[1] * 32 != k:
        raise ValueError(f"decode_activations: x [{m}, {k_cols}] does not match x_scale "
                         f"{tuple(x_scale.shape)} (want K/2 packed E2M1 or K E4M3 columns)")
    out = torch.empty(m, k, dtype=torch.bfloat16, device=x.device)
    if m == 0 or k == 0:
        return out
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    x = x if x.stride(-1) == 1 else x.contiguous()
    xs = x_scale if x_scale.stride(-1) == 1 else x_scale.contiguous()
    block_r, block_k = (4, 64) if interpret else (8, 512)
    grid = (triton.cdiv(m, block_r), triton.cdiv(k, block_k))
    _decode_e4m3_kernel[grid](x, xs, out.view(torch.int16) if interpret else out, m, k,
                              x.stride(0), xs.stride(0), k, BLOCK_R=block_r, BLOCK_K=block_k,
                              OUT_BITS=interpret)
    return out


def prepare_weight_scales(weight_scale: torch.Tensor, name: str = "weight_scale") -> int:
    """Check the E8M0 weight scale bytes once (uint8) and return the largest byte (255 when
    any block scale is NaN, 0 for an empty tensor), which callers pass to
    ``mxfp4_gemm(scale_max=...)`` so that the single-multiply decode, which has no NaN
    select, is used where it is exact (every byte <= 128)."""
    import torch

    if weight_scale.dtype != torch.uint8:
        raise TypeError(f"{name}: want E8M0 bytes as uint8, got {weight_scale.dtype}")
    return int(weight_scale.max()) if weight_scale.numel() else 0


def _pow2_floor(v: int) -> int:
    return 1 << (max(v, 1).bit_length() - 1)


def _block_k(k: int, want: int) -> int:
    bk = want
    while bk > 32 and k % bk:
        bk //= 2
    return bk


def _split(n: int, k: int, block_n: int, block_k: int, sm_count: int, per_sm: int = 3,
           least: int = 1) -> int:
    """Split-K factor giving about ``per_sm`` programs per SM (a power of two, at least
    ``least``), each split keeping at least four K tiles."""
    tiles = triton.cdiv(n, block_n)
    split = _pow2_floor(max(least, (per_sm * sm_count) // max(tiles, 1)))
    return min(split, max(1, k // (block_k * 4)))


def default_config(m: int, n: int, k: int, sm_count: int = 132, *,
                   layout: str = "checkpoint") -> GemmConfig:
    """The config used when none is given for a weight in ``layout`` (``LAYOUTS``).

    ``fragment`` (what ``prepare_weight`` stores on CUDA): the transposed product, 16 x 64 x
    256 tiles split along K for M <= 16 (as below), 64 x 128 x 128 with 8 warps up to M = 64
    and 128 x 128 x 128 beyond (see bench/results/mxfp4-h200.md).

    ``repacked`` and ``checkpoint``: a 16-row tile for M <= 16 and 64-row tiles up to
    M = 64, both split along K, and beyond that the weight decoded to bf16 once for torch's
    matmul (decoding per 128-row tile costs more); the ``repacked`` path reads the repacked
    words, ``pairs`` (M <= 16) and ``decode`` (M <= 64) the checkpoint bytes.

    M <= 16: 16x64 tiles with K tiles of 256 and 3 stages, split K for about six programs per
    SM and at least two (four at N = 8192, two at N = 28672): the fastest of the H200 sweeps
    on all three benchmark shapes, within 3% of the best fixed split in the split sweep
    (``bench/results/mxfp4-sweep-splits-h200.md``). M <= 64: about three programs per SM."""
    if layout not in LAYOUTS:
        raise ValueError(f"mxfp4_gemm: weight layout {layout!r}; valid: {LAYOUTS}")
    words = {"repacked": "repacked", "fragment": "fragment"}
    if m <= 16:
        block_k = _block_k(k, 256)
        split = _split(n, k, 64, block_k, sm_count, per_sm=6, least=2)
        return GemmConfig(16, 64, block_k, split, 4, 3, words.get(layout, "pairs"))
    if layout == "fragment":
        block_k = _block_k(k, 128)
        block_m = 64 if m <= 64 else 128
        # two programs per SM up to M = 64, one beyond (as the NVFP4 fragment kernels)
        split = _split(n * triton.cdiv(m, block_m), k, 128, block_k, sm_count,
                       per_sm=2 if m <= 64 else 1)
        return GemmConfig(block_m, 128, block_k, split, 8, 3, "fragment")
    if m <= 64:
        block_k = _block_k(k, 128)
        tiles_m = triton.cdiv(m, 64)
        return GemmConfig(64, 128, block_k, _split(n * tiles_m, k, 128, block_k, sm_count),
                          4, 3, words.get(layout, "decode"))
    return GemmConfig(128, 128, 64, 1, 8, 3, "dequant")


def candidate_configs(m: int, n: int, k: int) -> list[GemmConfig]:
    """Configs a tuning run tries for one shape (each valid for it: BLOCK_K divides K and
    every split gets at least two K tiles): 16 for M <= 16, 6 beyond, chosen so that the
    benchmark's sweep stays within a few minutes (every config compiles once per M class)."""
    out: list[GemmConfig] = []
    if m <= 16:
        # The pairs decode with 2..3 stages: the four-stage 16 x 64 x 512 tile holds 101 KB of
        # shared memory, two programs (8 warps) per SM, and Nsight Compute showed its
        # schedulers idle 51% of the cycles for want of an eligible warp.
        for bn, bk, split, warps, path, stages in (
                (32, 256, 4, 4, "decode", 4), (64, 256, 2, 4, "decode", 4),
                (128, 256, 2, 8, "decode", 4), (64, 512, 2, 4, "decode", 4),
                (64, 512, 2, 4, "pairs", 4), (64, 512, 2, 4, "pairs", 2),
                (64, 256, 2, 4, "pairs", 4), (64, 256, 2, 4, "pairs", 3),
                (64, 256, 2, 4, "pairs", 2), (64, 256, 4, 4, "pairs", 3),
                (128, 256, 2, 8, "pairs", 3), (64, 128, 4, 4, "pairs", 4),
                (64, 256, 2, 4, "pairs", 1), (64, 128, 4, 4, "pairs", 2),
                (32, 256, 4, 4, "pairs", 3), (64, 256, 2, 4, "repacked", 3),
                (64, 256, 4, 4, "repacked", 3), (128, 256, 2, 8, "repacked", 3),
                (64, 512, 2, 4, "repacked", 2), (64, 128, 4, 4, "repacked", 3),
                (128, 128, 4, 4, "repacked", 3), (64, 256, 3, 4, "repacked", 3),
                (64, 256, 5, 4, "repacked", 3), (64, 256, 6, 4, "repacked", 3),
                (64, 256, 7, 4, "repacked", 3), (64, 256, 2, 4, "fragment", 3),
                (64, 256, 4, 4, "fragment", 3), (64, 256, 3, 4, "fragment", 3),
                (64, 512, 2, 4, "fragment", 2), (128, 256, 2, 8, "fragment", 3),
                (64, 256, 2, 4, "fragment", 4),
                # unsplit: at N = 28672 its 448 programs fit one wave of the H200's 528
                # slots (four per SM) and need no sum kernel, yet it ran 53.4 us at M = 16
                # against 50.4 for the default's 896 (README)
                (64, 256, 1, 4, "fragment", 3)):
            if k % bk == 0 and k // (bk * split) >= 2:
                out.append(GemmConfig(16, bn, bk, split, warps, stages, path))
        out.append(GemmConfig(16, 64, 64, 1, 4, 3, "dequant"))
        return out
    for bm, bn, bk, split, warps, path in ((64, 128, 128, 1, 4, "decode"),
                                           (64, 128, 128, 4, 4, "decode"),
                                           (128, 128, 64, 1, 8, "decode"),
                                           (128, 128, 128, 1, 8, "decode"),
                                           (128, 128, 128, 1, 8, "scaled"),
                                           (64, 128, 128, 1, 4, "repacked"),
                                           (64, 128, 128, 4, 4, "repacked"),
                                           (128, 128, 64, 1, 8, "repacked"),
                                           (64, 128, 128, 1, 8, "fragment"),
                                           (64, 128, 128, 4, 8, "fragment"),
                                           (128, 128, 128, 1, 8, "fragment"),
                                           (128, 128, 128, 2, 8, "fragment")):
        if k % bk == 0 and k // (bk * split) >= 2:
            out.append(GemmConfig(bm, bn, bk, split, warps, 3, path))
    out.append(GemmConfig(128, 128, 64, 1, 8, 3, "dequant"))
    return out


def kernel_constexprs(cfg: GemmConfig, a_kind: int, *, k_even: bool, split: bool,
                      interpret: bool, out_bits: bool, fast: bool = True,
                      clamp_rows: bool = False) -> dict[str, object]:
    """The compile-time arguments of ``_mxfp4_gemm_kernel`` for one config (``clamp_rows``:
    M is neither 1 nor a multiple of BLOCK_M, see the kernel's ``CLAMP_ROWS``)."""
    return {"A_KIND": a_kind, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
            "BLOCK_K": cfg.block_k, "SPLIT_K": cfg.split_k if split else 1,
            "EVEN_K": k_even, "INTERPRET": interpret, "OUT_BF16_BITS": out_bits,
            "ASM": not interpret and _asm_target(), "FAST": fast,
            "SCALED": cfg.path == "scaled", "PAIRS": cfg.path == "pairs",
            "REPACKED": cfg.path == "repacked", "CLAMP_ROWS": clamp_rows,
            "SWAP": cfg.path == "fragment"}


def _asm_target() -> bool:
    """The PTX decode applies: compiling for an NVIDIA GPU (sm_80+), not the interpreter."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if os.environ.get("KERNELBAY_MXFP4_PLAIN_DECODE") == "1":  # the portable decode, to compare
        return False
    try:
        import torch
    except ImportError:  # pragma: no cover
        return False
    return torch.version.hip is None


def _halves(t: torch.Tensor) -> torch.Tensor:
    """A packed uint8 [R, K/2] tensor as int16 halfwords [R, K/4] (copied when its rows are
    not 2-byte aligned)."""
    import torch

    if t.stride(-1) != 1 or t.storage_offset() % 2 or t.stride(0) % 2:
        t = t.contiguous()
    return t.view(torch.int16)


def _words(t: torch.Tensor) -> torch.Tensor:
    """A packed uint8 [R, K/2] tensor (K a multiple of 32) as int32 words [R, K/8] (copied
    when its rows are not 4-byte aligned)."""
    import torch

    if t.stride(-1) != 1 or t.storage_offset() % 4 or t.stride(0) % 4:
        t = t.contiguous()
    return t.view(torch.int32)


def weight_layout(weight: torch.Tensor) -> str:
    """Which of ``LAYOUTS`` a packed weight is in (``ValueError`` naming them when none): uint8
    bytes, or repacked words whose order ``kernelbay.formats.words_order`` reads."""
    import torch
    from kernelbay.formats import words_order

    if weight.dtype == torch.uint8 and weight.dim() == 2:
        return "checkpoint"
    try:
        return "fragment" if words_order(weight) == "fragment" else "repacked"
    except ValueError:
        raise ValueError(f"mxfp4_gemm: weight must be packed E2M1 uint8 [N, K/2], its repacked "
                         f"words int32 [N, K/8] or fragment-order words int32 [N, K/32, 4], "
                         f"got {weight.dtype} {tuple(weight.shape)}") from None


def dequantize_weight(weight: torch.Tensor, weight_scale: torch.Tensor, *,
                      scale_max: int | None = None) -> torch.Tensor:
    """The packed weight in any of ``LAYOUTS`` with its E8M0 bytes [N, K/32] as bf16 [N, K],
    decoded on the device by ``triton_decode.decode_kernel`` (exactly the reference's
    values)."""
    import torch

    layout = weight_layout(weight)
    fragment = layout == "fragment"
    weight = weight.reshape(weight.shape[0], -1)
    repacked = layout != "checkpoint"
    n, k = weight.shape[0], weight.shape[1] * (8 if repacked else 2)
    out = torch.empty(n, k, dtype=torch.bfloat16, device=weight.device)
    if n == 0 or k == 0:
        return out
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    halves = weight.contiguous() if repacked else _halves(weight)
    scales = weight_scale if weight_scale.stride(-1) == 1 else weight_scale.contiguous()
    block_r, block_kh = (16, 16) if interpret else (32, 128)
    grid = (triton.cdiv(n, block_r), triton.cdiv(k // 4, block_kh))
    decode_kernel[grid](halves, scales, out.view(torch.int16) if interpret else out, n, k // 4,
                        halves.stride(0), scales.stride(0), k, BLOCK_R=block_r,
                        BLOCK_KH=block_kh, ASM=not interpret and _asm_target(),
                        FAST=scale_max is not None and scale_max <= FAST_SCALE_MAX_BYTE,
                        OUT_BITS=interpret, REPACKED=repacked, FRAGMENT=fragment)
    return out


def layout_weight(weight: torch.Tensor, layout: str) -> torch.Tensor:
    """The checkpoint's packed weight uint8 [N, K/2] in ``layout`` (``LAYOUTS``)."""
    if layout not in LAYOUTS:
        raise ValueError(f"mxfp4_gemm: weight layout {layout!r}; valid: {LAYOUTS}")
    if layout == "checkpoint":
        return weight
    from kernelbay.formats import repack_e2m1_words

    return repack_e2m1_words(weight.contiguous(), "fragment" if layout == "fragment" else "k")


def prepare_weight(weight: torch.Tensor) -> torch.Tensor:
    """The packed weight [N, K/2] in the layout this machine's kernels read best: the
    fragment-order words (``layout_weight``) where the PTX decode runs (the transposed
    product with the decoded tile as the dot's register operand), the checkpoint bytes
    elsewhere (the portable decode reads those with fewer operations)."""
    return layout_weight(weight, "fragment" if _asm_target() else "checkpoint")


def mxfp4_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, *,
               x_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
               config: GemmConfig | None = None, scale_max: int | None = None) -> torch.Tensor:
    """``x @ dequantize_mx(weight, weight_scale, "e2m1")^T`` for 2-D ``x`` (see the module
    comment for the three activation kinds; ``x_scale`` given means MX activations).

    ``scale_max``: the largest weight scale byte (``prepare_weight_scales``); at most
    128 selects the single-multiply decode, None the general one (exact for every byte).
    Output [M, N] in ``out_dtype`` (default: bf16).
    """
    import torch

    layout = weight_layout(weight)
    stored = weight
    weight = weight.reshape(weight.shape[0], -1)
    repacked = layout != "checkpoint"
    n, k = weight.shape[0], weight.shape[1] * (8 if repacked else 2)
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
    cfg = config or default_config(m, n, k, layout=layout)
    if cfg.path not in PATHS:
        raise ValueError(f"mxfp4_gemm: config path {cfg.path!r} is not one of {list(PATHS)}")
    if cfg.path not in READABLE[layout]:
        raise ValueError(f"mxfp4_gemm: config path {cfg.path!r} cannot read a weight in the "
                         f"{layout} layout; paths for it: {list(READABLE[layout])}")
    if cfg.block_k % 32 or cfg.block_k < 32:
        raise ValueError(f"mxfp4_gemm: block_k={cfg.block_k} must be a multiple of 32")
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if cfg.max_registers is not None and (not x.is_cuda or torch.version.hip is not None
                                          or interpret or not 24 <= cfg.max_registers <= 255):
        # a compile option of Triton's CUDA backend alone (ptxas's register bound)
        raise ValueError(f"mxfp4_gemm: max_registers={cfg.max_registers} applies to NVIDIA "
                         f"GPUs only, between 24 and 255; the activations are on {x.device}"
                         f"{' (ROCm)' if torch.version.hip else ''}")
    weight_scale = weight_scale if weight_scale.stride(-1) == 1 else weight_scale.contiguous()
    scaled = cfg.path == "scaled"
    if x_scale is not None and not scaled:
        # once per call, not per N tile; no host sync (CUDA-graph capturable)
        x, x_scale, kind = decode_activations(x, x_scale), None, _A_BF16
    if cfg.path == "dequant":
        w = dequantize_weight(stored, weight_scale, scale_max=scale_max)
        if out_dtype == torch.bfloat16:  # torch's matmul: float32 sums, one rounding
            return torch.matmul(x, w.T)
        return torch.matmul(x.float(), w.float().T).to(out_dtype)
    x = x if x.stride(-1) == 1 else x.contiguous()
    xs = weight_scale if x_scale is None else x_scale.contiguous()
    if scaled:
        w_arg = weight if weight.stride(-1) == 1 else weight.contiguous()
    elif cfg.path == "pairs":
        w_arg = _words(weight)
    elif repacked:
        w_arg = weight if weight.stride(-1) == 1 else weight.contiguous()
    else:
        w_arg = _halves(weight)
    split = max(1, min(cfg.split_k, triton.cdiv(k, cfg.block_k)))
    target = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32,
                                                device=x.device)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), split)
    out_bits = interpret and split == 1 and out_dtype == torch.bfloat16
    if out_bits:
        target = out.view(torch.int16)
    # whole K tiles: every split's range is whole tiles too (k_hi clamps the last one)
    const = kernel_constexprs(cfg, kind, k_even=k % cfg.block_k == 0,
                              split=split > 1, interpret=interpret, out_bits=out_bits,
                              fast=scale_max is not None and scale_max <= FAST_SCALE_MAX_BYTE,
                              # the fragment path's activations go to shared memory as the
                              # dot's second operand: masked rows cost it nothing there, and
                              # clamped ones lost 8-31% at M = 4 on the H200
                              clamp_rows=(m > 1 and m % cfg.block_m != 0
                                          and cfg.path != "fragment"))
    const["SPLIT_K"] = split
    pdl = triton_pdl.enabled(x.device)
    with triton_pdl.dependent(x.device, pdl):
        _mxfp4_gemm_kernel[grid](
            x, xs, w_arg, weight_scale, target, m, n, k,
            x.stride(0), xs.stride(0), w_arg.stride(0), weight_scale.stride(0),
            n, m * n if split > 1 else 0, **const, PDL=pdl,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            **({} if cfg.max_registers is None else {"maxnreg": cfg.max_registers}))
    if split > 1:
        block = 1024
        bits = interpret and out_dtype == torch.bfloat16
        # plain after its GEMM (see kernelbay_quant_nvfp4's sum_partials), so that the next
        # GEMM may depend on it programmatically
        with triton_pdl.dependent(x.device, pdl, depend=False):
            _split_k_reduce_kernel[(triton.cdiv(m * n, block),)](
                target, out.view(torch.int16) if bits else out, m * n, SPLIT_K=split,
                BLOCK=block, OUT_BF16_BITS=bits, PDL=pdl)
    return out


def config_dict(config: GemmConfig) -> dict[str, object]:
    """The config as a plain dict (for benchmark records)."""
    return asdict(config)
