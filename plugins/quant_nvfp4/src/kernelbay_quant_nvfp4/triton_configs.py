"""Kernel configurations of ``nvfp4-triton`` by batch size M, and the split-K rule.

Reasoning for the H200 defaults (132 SMs, 4.8 TB/s, 50 MB L2); ``bench/nvfp4/run.py
--configs all`` times every entry of ``CANDIDATES`` per shape so one GPU run can retune:

* Measured on the H200 (first run): with the weight decoded per element, integer and
  conversion work bounds the kernel, not HBM: the best M <= 16 kernel (``decode8``, PTX
  decode of int32 words of 8 nibbles) ran at ~1 TB/s, the same time for M = 1, 4 and 16,
  and about half of its K loop was the activation tile's per-tile power-of-two scaling,
  fp16 conversion and 8-way split (warp shuffles, max, shared-memory round trips).
* ``xprep`` (``triton_kernels.prepare_x``) moves that work to one pass over x per call: the
  K loop loads 8 contiguous fp16 slices per tile and decodes the weight words with the same
  PTX directly in the dot operand layout (the words are loaded into shared memory by the
  pipeliner and read back in that layout; no convert_layout of decoded weights). BLOCK_K
  must be 128, 256 or 512 (8 dots of BLOCK_K / 8 >= 16).
* ``swap_ab`` (``xpt-*``) computes ``out^T = W x^T``: on sm_90 the decoded weight is the
  warpgroup MMA's register operand (no shared-memory store of decoded weights; the
  ``xp-*`` form stores them for the MMA, 11.7 instructions per element at 64x128 against
  7.8), and the batch is the MMA's N, so M <= 16 needs no 64-row tile.
* ``halfword`` (``hw-*``, ``triton_halfword``): no activation pass; the weight read as
  int16 halfwords and decoded by PTX (two bf16 lanes per instruction, the block scale
  applied by one packed fma, exact) directly in the dot operand layout. sm_90 SASS of the
  K loop (triton 3.9, pointers/strides specialized): 6.0-6.2 instructions per element for
  the 16-row tiles against 8.4 for ``w8-16x64x256`` and 5.5 for ``xpt-16x128x256``; 5.3 at
  64x128x128 against 6.5 for ``xpt-64x128x128``. Not timed on a GPU yet.
* M <= 16 (decode) should be memory bound: the weight is 0.5625 B/element against bf16's
  2. BLOCK_M = 16 is the smallest tl.dot tile (unused rows masked). N = 8192 gives 64
  CTAs of 256 rows, so K is split until there are about four CTAs per SM (``split_k``);
  the fp32 partials (M x N x split, a few hundred KB at most) are summed by a second small
  kernel (deterministic: partials added in split order), or with ``sum_in_kernel`` by the
  last program of each tile (one launch less; the ``-sum`` candidates).
* M = 64: 256 x 64 (N x M) tiles, the weight decoded once for all rows.
* M > 64: ``dequant``: decode the whole weight into a temporary and call cuBLAS
  (``F.linear``), measured best at M = 256 so far (each call pays a 2 B/element write and
  read of the temporary); ``xpt-128x128x128`` is the fused contender in the sweep (9.6
  instructions per element and 128-row tile: ~2.4 G instructions at M = 256, N = K = 8192).
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
    #: ``decode8`` on activations prepared once per call (``triton_kernels.prepare_x``:
    #: fp16, per-row power-of-two scale, K in decode order), so the K loop touches x only
    #: through 8 contiguous fp16 loads per tile.
    xprep: bool = False
    #: With ``xprep``: the weight is the MMA's first operand (``out^T = W x^T``; on sm_90
    #: the warpgroup MMA takes it from registers, BLOCK_M is the MMA's N).
    swap_ab: bool = False
    #: With ``xprep`` and split-K: the last program of each tile adds the partials (in split
    #: order) and writes the output, instead of a second kernel (one launch less).
    sum_in_kernel: bool = False
    #: The halfword kernel (``triton_halfword``): four codes per int16 read, decoded in PTX
    #: to exact bf16 straight in the dot operand layout; activations used as they come.
    halfword: bool = False


#: (largest M served, config) in increasing M; the last entry serves every larger M.
#: Set from the third H200 sweep (bench/results/nvfp4-h200.md; geometric mean of the ratio to
#: bf16 over the three N x K shapes): M <= 16: ``hw-16x64x512-s2`` (1.34x at M = 1, 1.41x at
#: M = 16); M <= 64: ``hw-64x128x128`` (0.94x); larger M: dequantize then cuBLAS (0.55x, tied
#: with ``hw-128x128x64`` and steadier across shapes).
DEFAULT_CONFIGS: tuple[tuple[int, KernelConfig], ...] = (
    (16, KernelConfig("hw-16x64x512-s2", "fused", 16, 64, 512, 2, 4, 4, halfword=True)),
    (64, KernelConfig("hw-64x128x128", "fused", 64, 128, 128, 0, 4, 3, halfword=True)),
    (1 << 62, KernelConfig("dequant-cublas", "dequant")),
)


def _xp(name: str, block_m: int, block_n: int, block_k: int, warps: int, stages: int,
        swap_ab: bool = True, sum_in_kernel: bool = False) -> KernelConfig:
    return KernelConfig(name, "fused", block_m, block_n, block_k, 0, warps, stages,
                        dot16=True, decode8=True, xprep=True, swap_ab=swap_ab,
                        sum_in_kernel=sum_in_kernel)


def _hw(name: str, block_m: int, block_n: int, block_k: int, warps: int, stages: int,
        split_k: int = 0) -> KernelConfig:
    return KernelConfig(name, "fused", block_m, block_n, block_k, split_k, warps, stages,
                        halfword=True)


#: Alternatives the benchmark tries per shape (``--configs all``); BLOCK_M is lowered to
#: cover M where a config's is larger than needed. Kept from the second H200 sweep: the best
#: of each M range (``w8-16x64x256``, ``xpt-16x128x256``, ``xpt-64x128x128``,
#: ``xpt-128x128x128``, ``dequant-cublas``); new: the halfword kernels (``triton_halfword``),
#: 16-row tiles with K tiles of 256/512 for M <= 16, 64- and 128-row tiles above. Loop
#: instructions per weight element and row tile (sm_90 SASS, ``bench/nvfp4/registers.py
#: --loop``) in the comments.
CANDIDATES: tuple[KernelConfig, ...] = (
    KernelConfig("w8-16x64x256", "fused", 16, 64, 256, 0, 8, 4, True, True),  # 13.4
    _xp("xpt-16x128x256", 16, 128, 256, 8, 4),  # 5.5, 162 registers
    _hw("hw-16x64x512-s2", 16, 64, 512, 4, 4, split_k=2),
    _hw("hw-16x64x256", 16, 64, 256, 4, 4),
    _hw("hw-16x128x256", 16, 128, 256, 4, 4),
    _xp("xpt-64x128x128", 64, 128, 128, 8, 3),  # 7.8, 127 registers
    _hw("hw-64x128x128", 64, 128, 128, 4, 3),
    _xp("xpt-128x128x128", 128, 128, 128, 8, 3),  # 9.6, 208 registers
    _hw("hw-128x128x64", 128, 128, 64, 8, 3),
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
