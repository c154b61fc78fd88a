"""The NVFP4 GEMM of ``cuda/nvfp4_wgmma.cu`` for larger batches (the default table: M > 32) on
compute capability 9.0 (H100, H200; ``sm_90a``), bf16 activations, compiled at run time by
NVRTC (``cuda_jit``).

It reads the ``tiles`` layout the Triton kernels and the GEMV read (one stored copy per layer).
What it does that the Triton kernel does not: the product is computed transposed with
``wgmma``, the decoded weight as the register operand, and each 64-element half of a K chunk
is decoded while the tensor cores still work on the half before (asynchronous ``wgmma``
groups, three register sets in turn), so decode and matrix work overlap inside every
warpgroup instead of taking turns. The source explains the pipeline.
"""

from __future__ import annotations

import ctypes
import functools
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from kernelbay_quant_nvfp4.cuda_gemv import cuda_source

if TYPE_CHECKING:
    import torch
    from kernelbay.cuda_jit import Kernel

__all__ = ["ARCH", "DEFAULT", "FILL", "MAX_SPLIT", "NARROW", "NARROW_MIN_M", "WIDE", "WgmmaConfig",
           "base_config", "broken_reason", "build_options", "config_for_m", "launch_wgmma",
           "mark_broken", "mma_source", "nvfp4_wgmma_cuda", "prefers", "register_cap",
           "registers_needed", "shared_bytes", "source", "split_for", "stream_plan",
           "wgmma_kernel", "wgmma_unsupported"]

#: The architecture the kernel is built for: ``wgmma`` is an sm_90a feature (compute
#: capability 9.0 exactly; later architectures do not run sm_90a code).
ARCH = "sm_90a"
#: K must be whole 128-element chunks, N whole 16-row tiles (the tiles layout).
K_MULTIPLE = 128


@dataclass(frozen=True)
class WgmmaConfig:
    """One build: ``wg`` warpgroups of 64 weight rows per CTA, ``ntok`` tokens per CTA (the
    wgmma N, a multiple of 8 up to 256), ``stages`` shared-memory slots of one
    128-element K chunk, ``min_blocks`` CTAs per SM the registers are capped for."""

    wg: int = 2
    ntok: int = 128
    stages: int = 4
    min_blocks: int = 1
    #: K ranges (split K: fp32 partials summed in split order by a second kernel).
    split: int = 1
    #: Stream K instead: one CTA per SM and token tile, each taking an equal range of the
    #: layer's (row tile, chunk) units across tile boundaries (``stream_plan``); the tiles'
    #: segments summed like split K.
    stream_k: bool = False
    #: Steps per turn of the K loop, a multiple of the three register sets (``turn``); 0, the
    #: default: the least common multiple of 3 and ``stages`` where that is at most 12, so
    #: that every step's ring slot is a constant, else 3 (and 3 with stream K).
    unroll: int = 0

    @property
    def name(self) -> str:
        return (f"cw-g{self.wg}n{self.ntok}s{self.stages}b{self.min_blocks}"
                + (f"k{self.split}" if self.split > 1 else "")
                + ("sk" if self.stream_k else "")
                + (f"u{self.unroll}" if self.unroll else ""))

    @property
    def turn(self) -> int:
        """Steps per turn of the K loop (``unroll`` resolved): 12 for four stages, 6 for six,
        3 for three and otherwise."""
        if self.unroll:
            return self.unroll
        both = 3 * self.stages // math.gcd(3, self.stages)
        return 3 if self.stream_k or both > 12 else both

    def check(self) -> None:
        """``ValueError`` naming the field when the build cannot exist."""
        if self.wg not in (1, 2, 3, 4):
            raise ValueError(f"nvfp4 wgmma: wg={self.wg}; valid: 1, 2, 3, 4")
        if self.ntok % 8 or not 8 <= self.ntok <= 256:
            raise ValueError(f"nvfp4 wgmma: ntok={self.ntok}; valid: a multiple of 8 from 8 "
                             "to 256")
        if self.stages < 3:
            raise ValueError(f"nvfp4 wgmma: stages={self.stages}; valid: >= 3")
        if self.split < 1:
            raise ValueError(f"nvfp4 wgmma: split={self.split}; valid: >= 1")
        if self.unroll not in (0, 3, 6, 12) or (self.stream_k and self.turn != 3):
            raise ValueError(f"nvfp4 wgmma: unroll={self.unroll}; valid: 0 (chosen by stages), "
                             "3, 6 or 12 (0 or 3 with stream_k)")
        if self.stream_k and self.split != 1:
            raise ValueError(f"nvfp4 wgmma: split={self.split} with stream_k=True; stream K "
                             "sets its own ranges, valid: split=1")
        if shared_bytes(self) > 227 * 1024:
            raise ValueError(f"nvfp4 wgmma: {self.name} needs {shared_bytes(self)} bytes of "
                             "shared memory; at most 232448 on sm_90")
        if registers_needed(self) > register_cap(self):
            raise ValueError(f"nvfp4 wgmma: {self.name} needs about {registers_needed(self)} "
                             f"registers per thread, {register_cap(self)} fit {self.min_blocks} "
                             f"CTA(s) of {128 * self.wg} threads per SM: it would spill and "
                             "ptxas would serialize its wgmma groups")


def registers_needed(config: WgmmaConfig) -> int:
    """Registers per thread the kernel needs without spilling (``ntok / 2`` accumulators, three
    sets of 16 fragment registers and about 40 more; from sm_90a builds: 133 at 64 tokens,
    167 at 128, 231 at 256)."""
    return config.ntok // 2 + 88


def register_cap(config: WgmmaConfig) -> int:
    """Registers per thread available to ``min_blocks`` CTAs of ``wg`` warpgroups per SM."""
    return min(255, 65536 // (128 * config.wg * config.min_blocks))


@functools.cache
def stream_plan(row_tiles: int, chunks: int, ctas: int) -> tuple[int, int]:
    """(CTAs, segments per CTA) of a stream-K launch over ``row_tiles`` CTA row tiles of
    ``chunks`` 128-element chunks on at most ``ctas`` CTAs: CTA p takes units
    ``[p U // P, (p + 1) U // P)`` of the ``U = row_tiles * chunks`` (row tile, chunk) units
    (none empty), one segment per row tile its range touches; the second number is the most
    segments a CTA has. Cached: a launch asks it for every call of a layer."""
    units = row_tiles * chunks
    p = max(1, min(ctas, units))
    segments = max(((q + 1) * units // p - 1) // chunks - (q * units // p) // chunks + 1
                   for q in range(p))
    return p, segments


def shared_bytes(config: WgmmaConfig) -> int:
    """Dynamic shared memory of one CTA: per stage the activations (``ntok`` x 256 bytes), the
    CTA's words and codes (1152 bytes per 16-row tile) and two mbarriers, plus 1 KB to align
    the swizzle."""
    return config.stages * (config.ntok * 256 + config.wg * 4 * 1152 + 16) + 1024


#: The default build up to 128 tokens: two warpgroups (128 weight rows) and 128 tokens per CTA,
#: four stages (the fastest at M = 128 in the H200 sweeps,
#: bench/results/nvfp4-sweep-wgmma-splitk-h200.md and ...-cluster-h200.md).
DEFAULT = WgmmaConfig(2, 128, 4, 1)
#: The default build above 128 tokens: 256 tokens per warpgroup, so each decoded weight
#: register feeds twice the multiply-adds of ``DEFAULT`` (the decode was what bounded it at
#: M = 256), three stages (four do not fit in shared memory). At M = 256 on the H200 it ran
#: 55 / 197 / 168 us (8192 x 8192 split in two, 28672 x 8192, 8192 x 28672 split in two)
#: against 64 / 255 / 222 for ``DEFAULT`` (bench/results/nvfp4-sweep-wgmma-wide-h200.md).
WIDE = WgmmaConfig(2, 256, 3, 1)


#: The default build from ``NARROW_MIN_M`` to 64 tokens: four warpgroups (256 weight rows) and
#: 64 tokens per CTA, four stages. Each CTA reads the activations of its K range once for 256
#: rows (they come from L2, and at 64 tokens they outweigh the weight), and 16 warps per SM hide
#: more of the decode's latency. At M = 64 on the H200 it ran 26.7 / 79.7 / 72.7 us (8192 x 8192
#: split in four, 28672 x 8192 unsplit, 8192 x 28672 split in four) against 28.1 / 84.6 / 76.9
#: for the Triton kernel (bench/results/nvfp4-sweep-wgmma-m64-h200.md); with its K loop in turns
#: of twelve steps (``turn``), 24.3 / 69.1 / 66.2 us (bench/results/nvfp4-h200.md).
NARROW = WgmmaConfig(4, 64, 4, 1)
#: The fewest tokens the default build serves; below, the Triton kernels (not measured
#: against it there).
NARROW_MIN_M = 33
#: The share of the SMs a default build's CTAs (over ``split_for`` K ranges) must reach for
#: ``prefers``, and what ``split_for`` splits towards: at 28672 rows ``NARROW``'s 112 CTAs
#: (85% of 132 SMs) ran faster unsplit than split in two (79.7 against 87.8 us).
FILL = 0.8


def base_config(m: int) -> WgmmaConfig:
    """The unsplit default build for ``m`` tokens: ``WIDE`` above 128, ``DEFAULT`` above 64,
    else ``NARROW``."""
    if m > DEFAULT.ntok:
        return WIDE
    return DEFAULT if m > NARROW.ntok else NARROW


def _default_ctas(m: int, n: int) -> int:
    """CTAs of one K range of the default build for ``m`` tokens and ``n`` rows."""
    base = base_config(m)
    return -(-n // (64 * base.wg)) * -(-m // base.ntok)


#: The most K ranges the default build splits into (each at least ``MIN_SPLIT_CHUNKS``).
MAX_SPLIT = 4
MIN_SPLIT_CHUNKS = 4


def split_for(m: int, n: int, k: int, sms: int) -> int:
    """K ranges for the default build at ``m`` tokens, ``n`` rows and ``k`` inputs on ``sms``
    multiprocessors: enough for its CTAs (one per SM) to number ``FILL`` of the SMs, at most
    ``MAX_SPLIT`` and at least ``MIN_SPLIT_CHUNKS`` chunks of 128 per range. From the H200
    sweeps (``bench/results/nvfp4-sweep-wgmma-splitk-h200.md``, ``...-wide-h200.md``): M = 128
    on 8192-wide layers (64 CTAs) split in two ran 37.5 / 112 us against 44 / 132 for the
    Triton kernel, M = 256 (``WIDE``, 64 CTAs) split in two 55 / 168 us against 85 / 280
    unsplit; where the grid is already full (28672 rows) splitting lost 5-16%."""
    want = -(-int(FILL * sms) // max(_default_ctas(m, n), 1))
    return max(1, min(MAX_SPLIT, want, (k // 128) // MIN_SPLIT_CHUNKS))


def config_for_m(m: int, n: int = 0, k: int = 0, sms: int = 132) -> WgmmaConfig:
    """The build for ``m`` tokens, ``n`` output rows and ``k`` inputs on ``sms``
    multiprocessors: from ``NARROW_MIN_M`` tokens ``base_config`` split over ``split_for`` K
    ranges; below (never the default there) one warpgroup and the batch rounded up to 8
    tokens."""
    if m < NARROW_MIN_M:
        return WgmmaConfig(1, max(8, -(-m // 8) * 8), 4, 2)
    return replace(base_config(m), split=split_for(m, n, k, sms))


def prefers(m: int, n: int, k: int, sms: int) -> bool:
    """Whether the default build should serve ``m`` tokens, ``n`` rows and ``k`` inputs on
    ``sms`` multiprocessors: from ``NARROW_MIN_M`` tokens, when its CTAs over ``split_for`` K
    ranges number at least ``FILL`` of the SMs (fewer leave SMs idle; the split-K Triton
    kernel is faster there)."""
    return m >= NARROW_MIN_M and _default_ctas(m, n) * split_for(m, n, k, sms) >= FILL * sms


def mma_source(ntok: int) -> str:
    """``wgmma_k16``: one ``wgmma.mma_async m64n{ntok}k16`` (bf16 in, fp32 accumulators in
    place, or overwritten when ``add`` is 0) with the A fragment from four registers and B
    from a shared-memory descriptor. Written out per ``ntok`` because every accumulator is an
    operand of the instruction."""
    regs = ntok // 2
    acc = ", ".join(f"%{i}" for i in range(regs))
    a = ", ".join(f"%{regs + i}" for i in range(4))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
    return (
        "__device__ __forceinline__ void wgmma_k16(float (&d)[" + str(regs) + "], u32 a0, "
        "u32 a1, u32 a2, u32 a3, unsigned long long desc, u32 add = 1) {\n"
        '  asm volatile("{\\n.reg .pred p;\\nsetp.ne.b32 p, %' + str(regs + 5) + ', 0;\\n"\n'
        f'    "wgmma.mma_async.sync.aligned.m64n{ntok}k16.f32.bf16.bf16 {{{acc}}}, {{{a}}}, '
        f'%{regs + 4}, p, 1, 1, 0;\\n}}\\n"\n'
        f'    : {outs}\n'
        '    : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(add));\n'
        "}\n")


def source(config: WgmmaConfig) -> str:
    """The text NVRTC compiles for ``config``: the decode, the wgmma wrapper, the kernel."""
    return cuda_source("nvfp4_wgmma.cu", mma_source(config.ntok))


def build_options(config: WgmmaConfig) -> list[str]:
    """The NVRTC options (macros) of a build."""
    return [f"-DWG={config.wg}", f"-DNTOK={config.ntok}", f"-DSTAGES={config.stages}",
            f"-DMIN_BLOCKS={config.min_blocks}", f"-DSTREAM_K={int(config.stream_k)}",
            f"-DUNROLL={config.turn}"]


@functools.cache
def wgmma_kernel(config: WgmmaConfig, device: int) -> Kernel:
    """The compiled and loaded kernel of ``config`` for CUDA ``device`` (NVRTC, cached on
    disk; memoized per process)."""
    from kernelbay.cuda_jit import compile_cubin, load_kernel

    config.check()
    cubin = compile_cubin(source(config), "nvfp4_wgmma", ARCH, build_options(config))
    kernel = load_kernel(cubin, "nvfp4_wgmma", device)
    kernel.set_max_dynamic_shared(shared_bytes(config))
    return kernel


#: Devices where building or loading the kernel failed, with the error (``mark_broken``).
_BROKEN: dict[int, str] = {}


def mark_broken(device: int, reason: str) -> None:
    """Stop using the kernel on CUDA ``device`` for the rest of the process."""
    _BROKEN[device] = reason


def broken_reason(device: int) -> str | None:
    """Why the kernel is off on ``device`` (``mark_broken``), or ``None``."""
    return _BROKEN.get(device)


def wgmma_unsupported(x2: torch.Tensor, words: torch.Tensor,
                      codes: torch.Tensor) -> str | None:
    """Why these operands cannot run the kernel (``None`` when they can): bf16 activations
    [M, K] on a CUDA device of compute capability 9.0, K a multiple of 128, 16-byte aligned
    rows that do not overlap, words and scale codes in the ``tiles`` layout on the same device,
    16-byte aligned."""
    import torch

    k = x2.shape[1]
    if not x2.is_cuda or torch.version.hip is not None:
        return f"needs a CUDA device, activations are on {x2.device}"
    cc = torch.cuda.get_device_capability(x2.device)
    if cc != (9, 0):
        return f"needs compute capability 9.0 for sm_90a wgmma, got {cc[0]}.{cc[1]}"
    broken = broken_reason(x2.device.index or 0)
    if broken is not None:
        return f"did not build or load on this device: {broken}"
    if x2.dtype != torch.bfloat16:
        return f"needs bfloat16 activations, got {x2.dtype}"
    if k % K_MULTIPLE or k == 0:
        return f"needs K a positive multiple of {K_MULTIPLE}, got K = {k}"
    if x2.stride(-1) != 1 or x2.stride(0) % 8 or x2.data_ptr() % 16:
        return "needs 16-byte aligned activation rows"
    if x2.shape[0] > 1 and x2.stride(0) < k:
        return f"needs activation rows that do not overlap, got a row stride of " \
               f"{x2.stride(0)} for K = {k}"
    want_w = (k // 128, 256)
    if words.dtype != torch.int32 or words.dim() != 3 or tuple(words.shape[1:]) != want_w \
            or not words.is_contiguous():
        return f"needs words int32 [N/16, {want_w[0]}, {want_w[1]}], got {words.dtype} " \
               f"{tuple(words.shape)}"
    want_c = (words.shape[0], k // 128, 128)
    if codes.dtype != torch.uint8 or tuple(codes.shape) != want_c or not codes.is_contiguous():
        return f"needs uint8 scale codes {list(want_c)}, got {codes.dtype} {tuple(codes.shape)}"
    for name, t in (("words", words), ("scale codes", codes)):
        if t.device != x2.device or t.data_ptr() % 16:
            return f"needs the {name} 16-byte aligned on {x2.device}, got {t.device} at " \
                   f"{t.data_ptr():#x}"
    return None


def nvfp4_wgmma_cuda(x2: torch.Tensor, words: torch.Tensor, codes: torch.Tensor,
                     global_scale: torch.Tensor, bias: torch.Tensor | None,
                     config: WgmmaConfig | None = None) -> torch.Tensor:
    """``x2 [M, K] @ dequant(words, codes, global_scale)^T (+ bias)`` -> bf16 [M, N]
    (``wgmma_unsupported`` says what it needs; ``ValueError`` with that reason)."""
    reason = wgmma_unsupported(x2, words, codes)
    if reason is not None:
        raise ValueError(f"nvfp4 wgmma: {reason}")
    config = config or config_for_m(x2.shape[0], words.shape[0] * 16, x2.shape[1])
    return launch_wgmma(x2, words, codes, global_scale, bias, config)


def launch_wgmma(x2: torch.Tensor, words: torch.Tensor, codes: torch.Tensor,
                 global_scale: torch.Tensor, bias: torch.Tensor | None,
                 config: WgmmaConfig) -> torch.Tensor:
    """``nvfp4_wgmma_cuda`` for operands already checked by ``wgmma_unsupported``."""
    import torch
    from kernelbay.cuda_jit import programmatic_launch, tensor_map_2d

    m, k = x2.shape
    n = words.shape[0] * 16
    out = torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    if m == 0:
        return out
    if bias is not None:
        if bias.numel() != n:
            raise ValueError(f"nvfp4 wgmma: bias has {bias.numel()} elements, the layer has "
                             f"N = {n} outputs")
        bias = bias.to(x2.device, torch.bfloat16).contiguous()
    scale = global_scale.reshape(-1)[:1].to(x2.device, torch.float32).contiguous()
    device = x2.device.index if x2.device.index is not None else torch.cuda.current_device()
    kernel = wgmma_kernel(config, device)
    chunks = k // 128
    token_tiles = -(-m // config.ntok)
    row_tiles = -(-n // (64 * config.wg))
    part: torch.Tensor | None
    if config.stream_k:
        sms = torch.cuda.get_device_properties(x2.device).multi_processor_count
        ctas, per_split = stream_plan(row_tiles, chunks, max(1, sms // token_tiles))
        part = torch.empty(ctas, per_split, m, 64 * config.wg, dtype=torch.float32,
                           device=x2.device)
        grid = (token_tiles, ctas, 1)
    else:
        # K ranges of whole chunks, none empty (at most one per chunk).
        per_split = -(-chunks // max(1, min(config.split, chunks)))
        splits = -(-chunks // per_split)
        part = torch.empty(splits, m, n, dtype=torch.float32, device=x2.device) \
            if splits > 1 else None
        grid = (token_tiles, row_tiles, splits)
    # The activations' TMA map: boxes of 64 elements (one 128-byte swizzle span) x ntok rows.
    # One row has no stride to speak of (a [1, K] view may carry any): give it its own length.
    stride = x2.stride(0) if m > 1 else k
    xmap = tensor_map_2d(x2.data_ptr(), "bfloat16", m, k, stride * 2, config.ntok, 64)
    args = [xmap, ctypes.c_void_p(words.data_ptr()), ctypes.c_void_p(codes.data_ptr()),
            ctypes.c_void_p(scale.data_ptr()),
            ctypes.c_void_p(bias.data_ptr() if bias is not None else 0),
            ctypes.c_void_p(out.data_ptr()), ctypes.c_longlong(out.stride(0)),
            ctypes.c_void_p(part.data_ptr() if part is not None else 0),
            ctypes.c_int(m), ctypes.c_int(n), ctypes.c_int(k), ctypes.c_int(per_split)]
    kernel.launch(grid, (128 * config.wg, 1, 1), args,
                  torch.cuda.current_stream(x2.device).cuda_stream, shared_bytes(config),
                  programmatic=programmatic_launch())
    if part is not None:
        from kernelbay import triton_pdl

        from kernelbay_quant_nvfp4.triton_kernels import sum_partials, sum_stream_segments

        # the sums release too, so that the next GEMM may depend on them programmatically
        pdl = triton_pdl.enabled(x2.device)
        if config.stream_k:   # stream K always writes partials
            sum_stream_segments(part, bias, out, chunks, pdl=pdl)
        else:
            sum_partials(part, bias, out, pdl=pdl)
    return out
