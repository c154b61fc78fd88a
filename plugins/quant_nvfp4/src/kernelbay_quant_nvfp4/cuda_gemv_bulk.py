"""The bulk-copy NVFP4 GEMV of ``cuda/nvfp4_gemv_bulk.cu`` for M <= 16 on sm_90 GPUs (bf16
activations), compiled at run time by NVRTC (``cuda_jit``).

It reads the ``tiles`` layout the other kernels store (``linear_triton.layout_tensors``) and
decodes as ``cuda_gemv`` does; what differs is how the bytes arrive. A producer warp per CTA
streams whole stages by bulk copies (each 16-row tile's chunks of words and codes, and each
token row's slice of the activations), so a CTA keeps several stages in flight at the cost of
a few instructions, and its consumer warps share the activations from shared memory instead of
each reading them from L2. K is split between the ``wk`` consumer warps of a CTA and between
the ``splits`` CTAs of a thread-block cluster, whose partial sums are added in a fixed order
in distributed shared memory: one kernel, no workspace, the result independent of scheduling.

Where it runs: ``config_for`` picks it for layers whose CTAs fit one per SM (up to 2112 rows
on an H200 at M <= 8, about twice that above), where it is 1.2-1.5x faster than the per-lane
GEMV and the Triton kernel. Larger layers keep those: the decode's dependent instructions
bound a warp (Nsight Compute on the per-lane GEMV at 8192 x 8192: 3.7 cycles per issued
instruction, 1.9 warps per scheduler), and the per-lane build's four CTAs per SM hide that
better than one bulk CTA per SM does.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from kernelbay_quant_nvfp4.cuda_gemv import cuda_source, gemv_args

if TYPE_CHECKING:
    import torch
    from kernelbay.cuda_jit import Kernel

__all__ = ["MAX_M", "BulkGemvConfig", "broken_reason", "build_options", "bulk_kernel",
           "config_for", "fit_tokens", "launch_bulk", "mark_broken", "shared_bytes", "splits_for"]

#: Largest batch the kernel serves (two 8-token MMA tiles).
MAX_M = 16
#: Largest split of K (CTAs per cluster; 8 is the portable cluster size).
MAX_SPLITS = 8
#: Shared memory a CTA may use on sm_90 (227 KB).
SM_SHARED = 227 * 1024


@dataclass(frozen=True)
class BulkGemvConfig:
    """One build: ``wn`` x ``wk`` consumer warps (over rows x over K) and a producer warp,
    ``tm`` 16-row tiles per consumer warp, ``nt`` 8-token tiles, ``stages`` shared-memory
    stages of ``wk`` chunks each, K split over ``splits`` CTAs of a cluster (0: chosen per
    shape by ``splits_for``). The defaults are the best M <= 8 build of the H200 sweeps
    (``bench/results/nvfp4-sweep-bulk-h200.md``): one tile per CTA, eight warps over K, six
    stages (one CTA per SM); wider CTAs sharing each stage's activations lost there."""

    wn: int = 1
    tm: int = 1
    wk: int = 8
    nt: int = 1
    stages: int = 6
    splits: int = 0

    @property
    def name(self) -> str:
        """E.g. ``cb-t1w1x8s6ka``: tiles per warp, warps over rows x K, stages, split of K
        (``a``: ``splits_for``); token tiles follow M, so the name leaves them out."""
        split = "a" if self.splits == 0 else str(self.splits)
        return f"cb-t{self.tm}w{self.wn}x{self.wk}s{self.stages}k{split}"

    @property
    def rows(self) -> int:
        """Weight rows per CTA."""
        return self.wn * self.tm * 16

    def with_splits(self, splits: int) -> BulkGemvConfig:
        """The same build with K split over ``splits`` CTAs."""
        return replace(self, splits=splits)

    def resolved(self, n: int, k: int, sms: int) -> BulkGemvConfig:
        """The build with its split of K chosen for ``n`` x ``k`` (``splits_for``) when it
        leaves that to the shape (``splits`` 0)."""
        return self if self.splits else self.with_splits(splits_for(self, n, k, sms))


def stage_bytes(config: BulkGemvConfig) -> int:
    """Shared memory of one stage: words and codes of every tile's ``wk`` chunks, then the
    token rows' slices (each padded by 16 bytes)."""
    tiles = config.wn * config.tm
    return tiles * config.wk * 1152 + config.nt * 8 * (config.wk * 256 + 16)


def shared_bytes(config: BulkGemvConfig) -> int:
    """Dynamic shared memory of one CTA (the stages; the partial sums reuse them)."""
    return config.stages * stage_bytes(config)


def splits_for(config: BulkGemvConfig, n: int, k: int, sms: int = 132) -> int:
    """The split of K for ``n`` x ``k``: the most CTAs per cluster (1..8) that keep the grid
    within one CTA per SM and give every CTA at least three stages of chunks. In the H200
    sweep (``bench/results/nvfp4-sweep-bulk-h200.md``) a second wave cost more than the split
    gained: at M = 1, 1024 x 8192 took 5.9 us split in two and 6.5 whole, 2048 x 8192 6.9
    whole and 10.5 split in two."""
    blocks = -(-n // config.rows)
    chunks = k // 128
    best = 1
    for s in range(2, MAX_SPLITS + 1):
        if blocks * s <= sms and chunks >= 3 * s * config.wk:
            best = s
    return best


def config_for(m: int, n: int, k: int, sms: int = 132) -> BulkGemvConfig | None:
    """The build for ``m`` tokens and an ``n`` x ``k`` weight on a GPU of ``sms``
    multiprocessors, or ``None`` where the other kernels are faster: layers with more CTAs than
    SMs (the bulk build runs one CTA per SM; from 3584 x 8192 at M <= 8 the per-lane GEMV's
    four CTAs per SM hide the decode's latency better). Above 8 tokens, layers of more tiles
    than half the SMs take two tiles per CTA (each stage's 16 activation rows then feed twice
    the weight). From the H200 sweep (``bench/results/nvfp4-sweep-bulk-h200.md``): at M = 1
    1024 x 8192 5.9 against 9.0 us for the per-lane GEMV, 2048 x 8192 6.9 against 9.3,
    1536 x 7168 6.1 against 8.4; at M = 16 7.9, 9.6, 8.8 and 12.9 (3584 x 8192) against 9.5,
    11.7, 9.5 and 15.4 for the Triton ``pt-16x64x256-p3``; at 4096 x 8192 13.7 against
    13.3, the one loss measured."""
    tiles = -(-n // 16)
    if m > MAX_M:
        return None
    if m <= 8:
        config = BulkGemvConfig()
    else:
        config = BulkGemvConfig(tm=2 if tiles > sms // 2 else 1, nt=2, stages=4)
    if -(-tiles // config.tm) > sms:
        return None
    return config.resolved(n, k, sms)


def fit_tokens(config: BulkGemvConfig, m: int) -> BulkGemvConfig:
    """``config`` with the token tiles ``m`` needs, and as many of its stages as then fit
    an SM's shared memory (two token tiles double each stage's activation rows)."""
    fitted = replace(config, nt=1 if m <= 8 else 2)
    while fitted.stages > 2 and shared_bytes(fitted) > SM_SHARED:
        fitted = replace(fitted, stages=fitted.stages - 1)
    return fitted


@functools.cache
def _source() -> str:
    return cuda_source("nvfp4_gemv_bulk.cu")


def build_options(config: BulkGemvConfig) -> list[str]:
    """The NVRTC options (macros) of a build; ``splits`` must be resolved (>= 1)."""
    return [f"-DWN={config.wn}", f"-DTM={config.tm}", f"-DWK={config.wk}", f"-DNT={config.nt}",
            f"-DSTAGES={config.stages}", f"-DKS={config.splits}"]


@functools.cache
def bulk_kernel(config: BulkGemvConfig, device: int) -> Kernel:
    """The compiled and loaded kernel of ``config`` (``splits`` resolved) for CUDA
    ``device`` (NVRTC, cached on disk and per process)."""
    import torch
    from kernelbay.cuda_jit import compile_cubin, load_kernel

    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        raise ValueError(f"nvfp4 bulk GEMV: needs compute capability >= 9.0 (bulk copies, "
                         f"clusters), got {major}.{minor}")
    if not 1 <= config.splits <= MAX_SPLITS:
        raise ValueError(f"nvfp4 bulk GEMV: splits={config.splits}; valid: 1..{MAX_SPLITS}")
    if shared_bytes(config) > SM_SHARED:
        raise ValueError(f"nvfp4 bulk GEMV: {config.name} with {config.nt} token tiles needs "
                         f"{shared_bytes(config)} bytes of shared memory per CTA, more than "
                         f"{SM_SHARED} (fewer stages: fit_tokens)")
    if config.wn * config.tm + 8 * config.nt > 32:
        raise ValueError(f"nvfp4 bulk GEMV: {config.name} needs more than the producer warp's "
                         f"32 lanes (one per tile and token row)")
    cubin = compile_cubin(_source(), "nvfp4_gemv_bulk", f"sm_{major}{minor}",
                          build_options(config))
    kernel = load_kernel(cubin, "nvfp4_gemv_bulk", device)
    kernel.set_max_dynamic_shared(shared_bytes(config))
    return kernel


#: Devices where building or loading the kernel failed, with the error (``mark_broken``).
_BROKEN: dict[int, str] = {}


def mark_broken(device: int, reason: str) -> None:
    """Stop using the kernel on CUDA ``device`` for the rest of the process (the per-lane
    GEMV of ``cuda_gemv`` serves its layers)."""
    _BROKEN[device] = reason


def broken_reason(device: int) -> str | None:
    """Why the kernel is off on ``device`` (``mark_broken``), or ``None``."""
    return _BROKEN.get(device)


def launch_bulk(x2: torch.Tensor, words: torch.Tensor, codes: torch.Tensor,
                global_scale: torch.Tensor, bias: torch.Tensor | None,
                config: BulkGemvConfig, sms: int = 132) -> torch.Tensor:
    """``x2 [M, K] @ dequant(words, codes, global_scale)^T (+ bias)`` -> bf16 [M, N] for
    operands already checked by ``cuda_gemv.gemv_unsupported`` (``tiles`` layout)."""
    import torch

    m, k = x2.shape
    n = words.shape[0] * 16
    out = torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    if m == 0 or n == 0:
        return out
    if m > 8 * config.nt:
        raise ValueError(f"nvfp4 bulk GEMV: config {config.name} serves M <= {8 * config.nt}, "
                         f"got M = {m}")
    config = config.resolved(n, k, sms)
    if k // 128 < config.splits:
        raise ValueError(f"nvfp4 bulk GEMV: K = {k} has fewer 128-element chunks than "
                         f"splits = {config.splits}")
    if bias is not None:
        bias = bias.to(torch.bfloat16).contiguous()
    scale = global_scale.reshape(-1)[:1].float().contiguous()
    device = x2.device.index if x2.device.index is not None else torch.cuda.current_device()
    kernel = bulk_kernel(config, device)
    grid = (-(-n // config.rows), config.splits, 1)
    kernel.launch(grid, ((config.wn * config.wk + 1) * 32, 1, 1),
                  gemv_args(x2, words, codes, scale, bias, out),
                  torch.cuda.current_stream(x2.device).cuda_stream, shared_bytes(config))
    return out
