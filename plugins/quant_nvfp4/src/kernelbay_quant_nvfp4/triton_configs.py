"""Kernel configurations of ``nvfp4-triton`` by batch size M, and the split-K rule.

Reasoning for the H200 defaults (132 SMs, 4.8 TB/s, 50 MB L2); ``bench/nvfp4/run.py
--configs all`` times every entry of ``CANDIDATES`` per shape so one GPU run can retune:

* Where the weight is decoded per element, the integer and conversion operations bound the
  kernel before HBM does (a 4-bit weight gives each byte two elements to decode), so the
  ``dot16`` variant (exact fp16 weights, one packed fp16 multiply per two elements, no fp32
  round trip) serves M = 17..64. The ``decode8`` variant goes further for M <= 16 (int32
  words of 8 nibbles, inline PTX: prmt + shifts + masks on two 16-bit lanes at once, the
  scale applied by mul.f16x2), about 2 integer operations per element instead of 3-5, and
  the fewest registers (128 at 16x64x128). Its PTX was checked bit for bit by emulating it
  on the CPU and it compiles for sm_90, but it has not run on a GPU yet: if the GPU tests
  reject it, ``gemv16-16x32x128`` (139 registers, portable decode) is the fallback.
* M <= 16 (decode) is memory bound: the weight is 0.5625 B/element against bf16's 2. One CTA
  covers BLOCK_N = 64 output rows and walks K in 128-column tiles: each row of a tile is
  64 packed bytes (four 16-byte loads) and 8 block scales (one per 16 elements,
  contiguous). N = 8192 gives only 128 CTAs, fewer than the
  SMs, so K is split until there are about four CTAs per SM (``split_k``); the fp32
  partials (M x N x split, a few hundred KB at most) are summed by a second small kernel.
  BLOCK_M = 16 is the smallest tl.dot tile; unused rows are masked.
* M = 64: BLOCK_M = 64 and the same split rule keep the weight read once per 64 rows.
* M >= 128: 128 x 128 x 64 tiles with 8 warps (the weight is decoded once per 128 rows; the
  split rule still fills the SMs when N is small); or ``dequant``: decode the whole weight into a temporary and call cuBLAS
  (``F.linear``), which wins once the GEMM is compute bound (each call pays a 2 B/element
  write and read of the temporary).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["CANDIDATES", "DEFAULT_CONFIGS", "KernelConfig", "config_for", "split_k_for"]


@dataclass(frozen=True)
class KernelConfig:
    """One way to run the weight-only NVFP4 linear. ``path`` is ``fused`` (decode in
    registers) or ``dequant`` (Triton dequantize into a temporary, then ``F.linear``).
    ``split_k`` 0 means "choose by ``split_k_for``"."""

    name: str
    path: str = "fused"
    block_m: int = 16
    block_n: int = 64
    block_k: int = 256
    split_k: int = 0
    num_warps: int = 4
    num_stages: int = 4
    #: The fp16-dot variant of the kernel (exact fp16 weights, fewer operations per element;
    #: ``triton_kernels`` module doc).
    dot16: bool = False
    #: Read the weight as int32 words of 8 nibbles and decode them with inline PTX on CUDA
    #: (two elements per integer operation; implies ``dot16``; BLOCK_K >= 128).
    decode8: bool = False


#: (largest M served, config) in increasing M; the last entry serves every larger M.
#: Register counts (sm_90, triton 3.9, ``cuobjdump -res-usage``) guided the choice: every
#: default compiles without spilling (the 16x64x256 4-warp tiles of the portable decode
#: spill at 255 registers; so do all 64- and 128-row tiles with BLOCK_K 128).
DEFAULT_CONFIGS: tuple[tuple[int, KernelConfig], ...] = (
    # 128 registers, no spill, 14 KB shared (the word loads are pipelined): 4 CTAs per SM.
    (16, KernelConfig("w8-16x64x128", "fused", 16, 64, 128, 0, 4, 4, True, True)),
    (32, KernelConfig("tile16-32x128x64", "fused", 32, 128, 64, 0, 8, 3, True)),
    (64, KernelConfig("tile16-64x64x64", "fused", 64, 64, 64, 0, 8, 3, True)),
    (1 << 62, KernelConfig("tile-128x128x64", "fused", 128, 128, 64, 0, 8, 3)),
)

#: Alternatives the benchmark tries per shape (``--configs all``); BLOCK_M is lowered to
#: cover M where a config's is larger than needed.
CANDIDATES: tuple[KernelConfig, ...] = (
    KernelConfig("w8-16x64x128", "fused", 16, 64, 128, 0, 4, 4, True, True),
    KernelConfig("w8-16x64x128-s3", "fused", 16, 64, 128, 0, 4, 3, True, True),
    KernelConfig("w8-16x128x128", "fused", 16, 128, 128, 0, 8, 3, True, True),
    KernelConfig("w8-16x64x256", "fused", 16, 64, 256, 0, 8, 4, True, True),
    KernelConfig("w8-16x32x128", "fused", 16, 32, 128, 0, 4, 4, True, True),
    KernelConfig("gemv16-16x32x128", "fused", 16, 32, 128, 0, 4, 4, True),
    KernelConfig("gemv16-16x64x128", "fused", 16, 64, 128, 0, 4, 4, True),
    KernelConfig("gemv16-16x64x256", "fused", 16, 64, 256, 0, 8, 4, True),
    KernelConfig("gemv-16x32x128", "fused", 16, 32, 128, 0, 4, 4),
    KernelConfig("gemv-16x64x256", "fused", 16, 64, 256, 0, 8, 4),
    KernelConfig("tile16-32x128x64", "fused", 32, 128, 64, 0, 8, 3, True),
    KernelConfig("tile-32x128x64", "fused", 32, 128, 64, 0, 8, 3),
    KernelConfig("tile16-64x64x64", "fused", 64, 64, 64, 0, 8, 3, True),
    KernelConfig("tile-64x128x64", "fused", 64, 128, 64, 0, 8, 3),
    KernelConfig("tile-128x128x64", "fused", 128, 128, 64, 0, 8, 3),
    KernelConfig("tile-128x128x64-nosplit", "fused", 128, 128, 64, 1, 8, 3),
    KernelConfig("tile-128x128x64-s4", "fused", 128, 128, 64, 0, 8, 4),
    KernelConfig("dequant-cublas", "dequant"),
)

#: CTAs per SM the split-K rule aims for (enough loads in flight to saturate HBM).
CTAS_PER_SM = 4


def config_for(m: int, table: tuple[tuple[int, KernelConfig], ...] = DEFAULT_CONFIGS
               ) -> KernelConfig:
    """The configuration serving batch size ``m``."""
    for largest, config in table:
        if m <= largest:
            return config
    return table[-1][1]


def split_k_for(config: KernelConfig, m: int, n: int, k: int, sms: int) -> int:
    """``config.split_k`` when set, else the power of two that brings the grid to about
    ``CTAS_PER_SM`` CTAs per SM, keeping at least two K tiles per split."""
    if config.split_k:
        return config.split_k
    ctas = -(-m // config.block_m) * -(-n // config.block_n)
    k_tiles = -(-k // config.block_k)
    split = 1
    while ctas * split * 2 <= CTAS_PER_SM * sms and k_tiles // (split * 2) >= 2:
        split *= 2
    return split


def fit_block_m(config: KernelConfig, m: int) -> KernelConfig:
    """``config`` with BLOCK_M no larger than needed for ``m`` rows (at least 16)."""
    want = 16
    while want < m and want < config.block_m:
        want *= 2
    return replace(config, block_m=min(config.block_m, want))
