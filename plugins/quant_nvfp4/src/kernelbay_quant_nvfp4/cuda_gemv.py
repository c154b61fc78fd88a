"""The NVFP4 GEMV of ``cuda/nvfp4_gemv.cu`` for M <= 16 on CUDA GPUs (sm_80+, bf16
activations), compiled at run time by NVRTC (``cuda_jit``).

It reads the weight as the Triton kernels store it (fragment-order words and scale codes,
``linear_triton.layout_tensors``; the ``tiles`` layout by default, the row-major
``fragment`` layout too), so a layer stores one copy of its weight and larger batches go to
the Triton kernels. Why it is faster than the Triton split-K kernel at
decode batch sizes (the source explains the details): the K order inside a 128-element chunk
is permuted identically for weight and activations, so each lane decodes a whole 32-element
group (one 16-byte load, two block scales per row and chunk instead of eight) and loads its
activations as 16-byte vectors; the weight streams through shared memory by asynchronous
copies ``stages - 1`` chunks ahead, so no register holds a tile in flight; the split over K
is between the warps of one CTA and summed in warp order in shared memory (deterministic,
no partials in global memory, no second kernel).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from kernelbay.cuda_jit import Kernel

__all__ = ["MAX_M", "GemvConfig", "broken_reason", "build_options", "config_for_m",
           "gemv_args", "gemv_kernel", "gemv_unsupported", "launch_gemv", "mark_broken",
           "nvfp4_gemv_cuda", "shared_bytes", "stored_rows"]

#: Largest batch the kernel serves (two 8-token MMA tiles).
MAX_M = 16
#: K must be whole 128-element chunks.
K_MULTIPLE = 128


@dataclass(frozen=True)
class GemvConfig:
    """One build of the kernel: ``tm`` 16-row tiles per CTA, ``nt`` 8-token tiles, ``wk``
    warps splitting K, ``stages`` shared-memory stages (even), ``min_blocks`` CTAs per SM
    the register budget is set for (``__launch_bounds__``)."""

    tm: int = 2
    nt: int = 1
    wk: int = 8
    stages: int = 4
    min_blocks: int = 2
    #: Reads the ``tiles`` weight layout (else ``fragment``).
    tiled: bool = True
    #: Warps side by side over rows (each ``tm`` tiles) sharing a K part, so that their
    #: activation loads hit the same L1 lines.
    wn: int = 1
    #: Under programmatic launches, let the next launch start its CTAs when this kernel
    #: starts instead of once every CTA is past its K loop (``config_for_m`` picks it for
    #: grids that fill one wave: ``docs/kernels.md``, 3-17% faster there than plain
    #: launches, up to 73% slower where the next call's CTAs share half-empty SMs); no
    #: effect on plain launches.
    early_release: bool = False

    @property
    def name(self) -> str:
        kind = "ct" if self.tiled else "cu"
        return (f"{kind}-t{self.tm}n{self.nt}w{self.wn}x{self.wk}s{self.stages}"
                f"b{self.min_blocks}" + ("e" if self.early_release else ""))


def stored_rows(words: torch.Tensor, tiled: bool) -> int:
    """N of a stored weight: the ``tiles`` layout's first dimension counts 16-row tiles."""
    return words.shape[0] * (16 if tiled else 1)


def shared_bytes(config: GemvConfig) -> int:
    """Dynamic shared memory of one CTA: the pipeline's slots (16-byte words and 4-byte codes
    of two rows per tile, per lane, warp and stage) or the warps' partial sums, the larger."""
    warps = config.wn * config.wk
    pipeline = warps * config.stages * config.tm * 2 * (512 + 128)
    partial = warps * config.tm * 16 * config.nt * 8 * 4
    return max(pipeline, partial)


def config_for_m(m: int, n: int = 0, k: int = 0, sms: int = 132, *,
                 programmatic: bool = False) -> GemvConfig:
    """The default build for ``m`` tokens (one or two 8-token tiles), ``n`` output rows and
    ``k`` inputs on a GPU of ``sms`` multiprocessors: two 16-row tiles per CTA; K split over
    eight warps when the CTAs fit in one wave of two per SM and each warp still gets at
    least 16 chunks (K >= 16384); for 2 to 8 tokens on layers whose rows fill a wave of two
    CTAs per SM in 128-row blocks, four warps side by side over rows with K split in two
    (the four warps read the same activations, so three of every four of those loads hit
    L1); else K over four warps with four CTAs per SM (more, shorter CTAs; a warp's part of
    K twice as long). From the H200 sweeps (``bench/results/nvfp4-sweep-cuda-h200.md``:
    8192 x 8192 13.9 against 14.8 us, 28672 x 8192 39.4 against 41.9, 8192 x 28672 36.8
    against 38.1 for the eight-warp build; ``bench/results/nvfp4-sweep-rows-h200.md``:
    28672 x 8192 at 2 / 4 / 8 tokens 40.2 / 40.0 / 41.6 us against 41.9 / 43.0 / 45.0 for
    the four-warp K split, 39.6 against 38.9 at one token, where it is not taken).

    ``programmatic`` (the launch will be a programmatic dependent, ``programmatic_launch``):
    of the three builds above, released early, the one whose CTAs fill the most of one wave
    of its CTA slots without passing it, when that is at least 80% of the wave; else the
    rule above (released after the K loop). Early release lets the next call's CTAs into the
    free slots while this one runs: where a grid left slots empty that was up to 73% slower,
    where it filled them 3-17% faster than plain launches (``docs/kernels.md``)."""
    nt = 1 if m <= 8 else 2
    if programmatic:
        fills = [(-(-n // (16 * b.tm * b.wn)) / (b.min_blocks * sms), b)
                 for b in (GemvConfig(2, nt, 8, 4, 2, early_release=True),
                           GemvConfig(2, nt, 2, 4, 2, wn=4, early_release=True),
                           GemvConfig(2, nt, 4, 4, 4, early_release=True))]
        fill, best = max(((f, b) for f, b in fills if f <= 1.0), default=(0.0, None),
                         key=lambda fb: fb[0])
        if best is not None and fill >= 0.8:
            return best
    ctas = -(-n // 32)
    if ctas <= 2 * sms * 1.1 and k >= 16384:
        return GemvConfig(2, nt, 8, 4, 2)
    rows = GemvConfig(2, nt, 2, 4, 2, wn=4)
    if 2 <= m <= 8 and n // (16 * rows.tm * rows.wn) >= 0.8 * rows.min_blocks * sms:
        return rows
    return GemvConfig(2, nt, 4, 4, 4)


def cuda_source(file: str, prelude: str = "") -> str:
    """A kernel source of this plugin's ``cuda`` folder as NVRTC compiles it: after the word
    layout's constants (``kernelbay.formats.e2m1_words``, as macros), the shared
    fragment-word decode (``nvfp4_lanes.cuh``; NVRTC resolves only the core's headers, so the
    plugin's own is put in front of the text) and ``prelude`` (generated device code the
    kernel calls)."""
    from kernelbay.formats.e2m1_words import (
        GATHER_MASK,
        GATHER_MULTIPLIER,
        LANE_MASK,
        LANE_ROTATIONS,
    )

    layout = (f"#define E2M1_LANE_MASK {LANE_MASK:#x}u\n"
              f"#define E2M1_ROT1 {LANE_ROTATIONS[1]}\n#define E2M1_ROT2 {LANE_ROTATIONS[2]}\n"
              f"#define E2M1_GATHER_MASK {GATHER_MASK:#x}u\n"
              f"#define E2M1_GATHER_MULTIPLIER {GATHER_MULTIPLIER:#x}u")
    folder = resources.files("kernelbay_quant_nvfp4") / "cuda"
    return "\n".join([layout, (folder / "nvfp4_lanes.cuh").read_text(encoding="utf-8"), prelude,
                      (folder / file).read_text(encoding="utf-8")])


@functools.cache
def _source() -> str:
    return cuda_source("nvfp4_gemv.cu")


def build_options(config: GemvConfig) -> list[str]:
    """The NVRTC options (macros) of a build."""
    return [f"-DTM={config.tm}", f"-DNT={config.nt}", f"-DWK={config.wk}",
            f"-DSTAGES={config.stages}", f"-DMIN_BLOCKS={config.min_blocks}",
            f"-DTILED={int(config.tiled)}", f"-DWN={config.wn}",
            f"-DEARLY_RELEASE={int(config.early_release)}"]


@functools.cache
def gemv_kernel(config: GemvConfig, device: int) -> Kernel:
    """The compiled and loaded kernel of ``config`` for CUDA ``device`` (NVRTC, cached on
    disk; memoized per process, so a launch does not touch the disk cache again)."""
    import torch
    from kernelbay.cuda_jit import compile_cubin, load_kernel

    major, minor = torch.cuda.get_device_capability(device)
    if config.stages % 2 or config.stages < 2:
        raise ValueError(f"nvfp4 CUDA GEMV: stages={config.stages}; valid: an even number >= 2")
    cubin = compile_cubin(_source(), "nvfp4_gemv", f"sm_{major}{minor}", build_options(config))
    kernel = load_kernel(cubin, "nvfp4_gemv", device)
    kernel.set_max_dynamic_shared(shared_bytes(config))
    return kernel


#: Devices where building or loading the kernel failed, with the error (``mark_broken``).
_BROKEN: dict[int, str] = {}


def mark_broken(device: int, reason: str) -> None:
    """Stop using the kernel on CUDA ``device`` for the rest of the process (its build or
    load failed: an architecture NVRTC does not know, a driver older than the cubin)."""
    _BROKEN[device] = reason


def broken_reason(device: int) -> str | None:
    """Why the kernel is off on ``device`` (``mark_broken``), or ``None``."""
    return _BROKEN.get(device)


def gemv_unsupported(x2: torch.Tensor, words: torch.Tensor, codes: torch.Tensor,
                     tiled: bool = True) -> str | None:
    """Why these operands cannot run the kernel (``None`` when they can): bf16 activations
    [M <= 16, K] on a CUDA device of compute capability >= 8.0, K a multiple of 128, 16-byte
    aligned rows, words and scale codes in the ``tiles`` (``tiled``) or ``fragment``
    layout."""
    import torch

    m, k = x2.shape
    if not x2.is_cuda or torch.version.hip is not None:
        return f"needs a CUDA device, activations are on {x2.device}"
    if torch.cuda.get_device_capability(x2.device)[0] < 8:
        return "needs compute capability >= 8.0 for bf16 mma.sync"
    broken = broken_reason(x2.device.index or 0)
    if broken is not None:
        return f"did not build or load on this device: {broken}"
    if x2.dtype != torch.bfloat16:
        return f"needs bfloat16 activations, got {x2.dtype}"
    if m > MAX_M:
        return f"serves M <= {MAX_M}, got M = {m}"
    if k % K_MULTIPLE:
        return f"needs K a multiple of {K_MULTIPLE}, got K = {k}"
    if x2.stride(-1) != 1 or x2.stride(0) % 8 or x2.data_ptr() % 16:
        return "needs 16-byte aligned activation rows"
    want_w = (k // 128, 256) if tiled else (k // 32, 4)
    rows = "N/16" if tiled else "N"
    if words.dtype != torch.int32 or words.dim() != 3 or tuple(words.shape[1:]) != want_w \
            or not words.is_contiguous():
        return f"needs words int32 [{rows}, {want_w[0]}, {want_w[1]}], got {words.dtype} " \
               f"{tuple(words.shape)}"
    want_c = (words.shape[0], k // 128, 128) if tiled else (words.shape[0], k // 16)
    if codes.dtype != torch.uint8 or tuple(codes.shape) != want_c or not codes.is_contiguous():
        return f"needs uint8 scale codes {list(want_c)}, got {codes.dtype} {tuple(codes.shape)}"
    return None


def nvfp4_gemv_cuda(x2: torch.Tensor, words: torch.Tensor, codes: torch.Tensor,
                    global_scale: torch.Tensor, bias: torch.Tensor | None,
                    config: GemvConfig | None = None) -> torch.Tensor:
    """``x2 [M, K] @ dequant(words, codes, global_scale)^T (+ bias)`` -> bf16 [M, N] for
    M <= 16 (``gemv_unsupported`` says what else it needs; ``ValueError`` with that reason)."""
    from kernelbay.cuda_jit import programmatic_launch

    reason = gemv_unsupported(x2, words, codes, config.tiled if config else True)
    if reason is not None:
        raise ValueError(f"nvfp4 CUDA GEMV: {reason}")
    if config is None:
        index = device_index(x2)
        config = config_for_m(x2.shape[0], stored_rows(words, True), x2.shape[1],
                              sm_count(index), programmatic=programmatic_launch(index))
    return launch_gemv(x2, words, codes, global_scale, bias, config)


@functools.cache
def sm_count(device: int) -> int:
    """Multiprocessors of CUDA ``device`` (asked once)."""
    import torch

    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def device_index(x: torch.Tensor) -> int:
    """The CUDA device index of ``x`` (the current device when it names none)."""
    import torch

    return x.device.index if x.device.index is not None else torch.cuda.current_device()


def gemv_args(x2: torch.Tensor, words: torch.Tensor, codes: torch.Tensor,
              scale: torch.Tensor, bias: torch.Tensor | None,
              out: torch.Tensor) -> list[ctypes._SimpleCData[Any]]:
    """The parameters both GEMV kernels take, in order: activations and their row stride,
    words, codes, the fp32 global scale, the bf16 bias or null, the output and its row
    stride, M, N, K."""
    m, k = x2.shape
    return [ctypes.c_void_p(x2.data_ptr()), ctypes.c_longlong(x2.stride(0)),
            ctypes.c_void_p(words.data_ptr()), ctypes.c_void_p(codes.data_ptr()),
            ctypes.c_void_p(scale.data_ptr()),
            ctypes.c_void_p(bias.data_ptr() if bias is not None else 0),
            ctypes.c_void_p(out.data_ptr()), ctypes.c_longlong(out.stride(0)),
            ctypes.c_int(m), ctypes.c_int(out.shape[1]), ctypes.c_int(k)]


def launch_gemv(x2: torch.Tensor, words: torch.Tensor, codes: torch.Tensor,
                global_scale: torch.Tensor, bias: torch.Tensor | None,
                config: GemvConfig) -> torch.Tensor:
    """``nvfp4_gemv_cuda`` for operands already checked by ``gemv_unsupported`` (the
    method's hot path checks once per call, not once per launch)."""
    import torch
    from kernelbay.cuda_jit import programmatic_launch

    m = x2.shape[0]
    n = stored_rows(words, config.tiled)
    out = torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    if m == 0 or n == 0:
        return out
    if m > 8 * config.nt:
        raise ValueError(f"nvfp4 CUDA GEMV: config {config.name} serves M <= {8 * config.nt}, "
                         f"got M = {m}")
    if bias is not None:
        bias = bias.to(torch.bfloat16).contiguous()
    scale = global_scale.reshape(-1)[:1].float().contiguous()
    device = device_index(x2)
    kernel = gemv_kernel(config, device)
    tiles = -(-n // 16)
    grid = (-(-tiles // (config.tm * config.wn)), 1, 1)
    args = gemv_args(x2, words, codes, scale, bias, out)
    kernel.launch(grid, (32 * config.wk * config.wn, 1, 1), args,
                  torch.cuda.current_stream(x2.device).cuda_stream, shared_bytes(config),
                  programmatic=programmatic_launch())
    return out
