"""Kernel configurations of ``nvfp4-triton`` by batch size M, and the split-K rule.

Reasoning for the H200 defaults (132 SMs, 4.8 TB/s, 50 MB L2); ``bench/nvfp4/run.py
--configs all`` (or name prefixes) times entries of ``CANDIDATES`` per shape so one GPU run
can retune:

* Decode batches (M <= 8, bf16, CUDA) run the CUDA GEMV of ``cuda_gemv`` on the ``tiles``
  layout (``ct-*``; built by NVRTC; ``CUDA_FALLBACK`` where it cannot run): 2.3-3.1x bf16 on
  the H200 against 1.8-2.4x for the Triton kernel below (``bench/results/
  nvfp4-sweep-cuda-h200.md``). The tiles layout (each 16-row tile's 128-element chunks
  contiguous) is what made it fast: on the row-major fragment layout the same kernel streamed
  2.2-2.6 TB/s, on tiles 3.2-3.6.
* Every other row of the default table is the kernel of ``triton_halfword`` computing
  the product transposed on fragment-order words with scale codes (``linear_triton.
  layout_tensors``), reading them in the tiles layout (``pt-*``; as fast as on the fragment
  layout, ``pf-*``, at M = 16 and 3-17% faster at M = 64 and 256:
  ``bench/results/nvfp4-sweep-tiles-h200.md``): the decoded weight is the register operand
  of the sm_90 wgmma, so no
  activation fragments are assembled in registers and no decoded tile passes through shared
  memory; a block scale costs one byte extract and one multiply-add per thread. sm_90 SASS of
  the K loop (triton 3.9, pointers/strides specialized): 3.6 instructions per element for
  ``pf-16x64x256-p3`` against 4.6 for the repacked K-order ``pr-16x64x256-p3`` and 4.6-6.2 for
  the checkpoint-layout decodes (halfwords, ``hw-*``; words, ``pw-*``), which stay in the
  sweep. The tiles layout needs N a multiple of 16 and K of 128 (else ``FRAGMENT_CONFIGS``),
  the fragment order K a multiple of 32 (else ``K_ORDER_CONFIGS``).
* Earlier fused kernels (per-element fp32 / fp16 decodes, int32 words of 8 nibbles decoded
  in PTX, activations prepared once per call with the operands swapped, split sums in the
  kernel) were measured in the first three H200 sweeps, lost, and were removed.
* M <= 16 (decode) should be memory bound: the weight is 0.5625 B/element against bf16's 2.
  BLOCK_M = 16 is the smallest tl.dot tile (unused rows masked). N = 8192 gives 128 programs
  of 64 rows, so K is split (``split_k_for``: the largest power of two keeping the grid at or
  below ``per_sm`` programs per SM); the fp32 partials (M x N x split, a few hundred KB at
  most) are summed by a second small kernel (deterministic: partials added in split order).
* M <= 64: 64 x 128 tiles with 8 warps (two warpgroups of 64 weight rows), split for about
  two programs per SM; larger M: 128-row tiles, one program per SM (splitting them wrote
  more partials than it gained).
* M > 32 on compute capability 9.0 (bf16, NVRTC): the wgmma GEMM of ``cuda_wgmma``
  (``cw-default``: four warpgroups of 64 weight rows and 64 tokens per CTA up to M = 64; two
  warpgroups, 128 tokens per CTA and four stages up to M = 128; 256 tokens per CTA and three
  stages above), where its grid, split over K where it
  is small (``cuda_wgmma.split_for``), gives about a CTA per SM (``cuda_wgmma.prefers``):
  each warpgroup decodes the next 64-element half of the weight while the tensor cores run
  the previous one, which the Triton loop cannot express. H200, M = 256 (256 tokens per CTA):
  55 / 197 / 168 us against 75-84 / 295-328 / 258-297 us for the Triton kernels at
  8192 x 8192 / 28672 x 8192 / 8192 x 28672 (cuBLAS on the bf16 weight: 51 / 201 / 194 us);
  M = 128: 127 against 146 us at 28672 x 8192 (64 x 224 CTAs, unsplit) and, split in two,
  37.5 / 112 against 44 / 132 us on the 8192-wide shapes; M = 64: 26.7 / 79.7 / 72.7 against
  28.1 / 84.6 / 76.9 us. Elsewhere ``WGMMA_FALLBACK`` runs the Triton kernel of the tiles
  layout.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kernelbay_quant_nvfp4.cuda_gemv import GemvConfig
from kernelbay_quant_nvfp4.cuda_gemv_bulk import BulkGemvConfig
from kernelbay_quant_nvfp4.cuda_wgmma import WgmmaConfig

__all__ = ["CANDIDATES", "CUDA_FALLBACK", "DEFAULT_CONFIGS", "FRAGMENT_CONFIGS",
           "K_ORDER_CONFIGS", "LAYOUTS", "WGMMA_FALLBACK", "KernelConfig",
           "config_for", "layout_of", "serving_name", "split_k_for", "table_for", "table_layout"]


@dataclass(frozen=True)
class KernelConfig:
    """One way to run the weight-only NVFP4 linear. ``path`` is ``repacked`` (the fused
    kernel on the word layout of ``kernelbay.formats.e2m1_words``,
    ``triton_halfword.decode_words``), ``fused`` (the
    halfword kernel on the checkpoint layout: decode in registers), ``pairs`` (the same
    kernel reading 32-bit words, ``triton_halfword.decode_words``), ``fragment`` / ``tiles``
    (the transposed product on fragment-order words with scale codes, in the fragment or the
    tiles layout), ``cuda`` / ``cuda-tiles`` (the CUDA GEMV of ``cuda_gemv`` on either layout,
    build ``gemv``), ``cuda-bulk`` (the bulk-copy GEMV of ``cuda_gemv_bulk``, build ``bulk``), ``cuda-wgmma`` (the sm_90a GEMM of ``cuda_wgmma`` on the tiles layout,
    build ``wgmma``) or ``dequant`` (Triton dequantize into a temporary, then ``F.linear``).
    ``split_k`` 0 means "choose by ``split_k_for``"."""

    name: str
    path: str = "fused"
    block_m: int = 16
    block_n: int = 64
    block_k: int = 256
    split_k: int = 0
    num_warps: int = 4
    num_stages: int = 4
    #: Programs per SM the split-K rule aims for (``split_k_for``).
    per_sm: int = 4
    #: The CUDA GEMV build of a ``cuda`` / ``cuda-tiles`` config (its token tiles follow M;
    #: ``None``: ``cuda_gemv.config_for_m``).
    gemv: GemvConfig | None = None
    #: The CUDA wgmma GEMM build of a ``cuda-wgmma`` config (``None``:
    #: ``cuda_wgmma.config_for_m``).
    wgmma: WgmmaConfig | None = None
    #: The build of a ``cuda-bulk`` config (the bulk-copy GEMV of ``cuda_gemv_bulk``, its
    #: token tiles following M; ``None``: ``cuda_gemv_bulk.config_for``, which picks a build
    #: for small layers on sm_90 and none elsewhere: then ``CUDA_FALLBACK`` runs).
    #: ``ct-default`` also runs that rule's build where it picks one.
    bulk: BulkGemvConfig | None = None


#: (largest M served, config) in increasing M; the last entry serves every larger M.
#: Set from the H200 sweeps of the fragment-order kernels (bench/results/
#: nvfp4-sweep-fragment-vs-repacked-h200.md against the repacked kernels, then
#: nvfp4-sweep-fragment-h200.md with fixed splits): the transposed product on fragment-order
#: words with scale codes is the fastest at every M and shape measured. M <= 16
#: ``pf-16x64x256-p3`` (15-19% ahead of the repacked ``pr-16x64x256-p3``); M <= 64 the 64 x 128 x 128 tile with 8 warps
#: aiming for two programs per SM (four splits at N = 8192, none at N = 28672: 7-14% ahead
#: of the eight and two of the four-per-SM target); larger M 128 x 128 x 128 with one program
#: per SM (no split at N = K = 8192, M = 256: 77 us against 99 us split in four and 101 us
#: for the repacked ``pr-128x128x64``).
FRAGMENT_CONFIGS: tuple[tuple[int, KernelConfig], ...] = (
    (16, KernelConfig("pf-16x64x256-p3", "fragment", 16, 64, 256, 0, 4, 3, per_sm=7)),
    (64, KernelConfig("pf-64x128x128-w8", "fragment", 64, 128, 128, 0, 8, 3, per_sm=2)),
    (1 << 62, KernelConfig("pf-128x128x128-w8", "fragment", 128, 128, 128, 0, 8, 3, per_sm=1)),
)

#: The default table, on the tiles layout (N a multiple of 16, K of 128; other layers run
#: ``FRAGMENT_CONFIGS`` or ``K_ORDER_CONFIGS``, ``table_for``): the CUDA GEMV for decode
#: batches (``cuda_gemv``; where it cannot run, ``run_config`` takes ``CUDA_FALLBACK``), the
#: fragment kernels reading the tiles layout above, and for larger batches the wgmma GEMM
#: (``cuda_wgmma``; where it cannot run or its grid would leave SMs idle,
#: ``WGMMA_FALLBACK``).
#: The Triton kernels of the tiles layout, by batch size (the default table's middle rows and
#: where neither CUDA kernel can run).
_TILES_TRITON: tuple[tuple[int, KernelConfig], ...] = (
    (16, KernelConfig("pt-16x64x256-p3", "tiles", 16, 64, 256, 0, 4, 3, per_sm=7)),
    (64, KernelConfig("pt-64x128x128-w8", "tiles", 64, 128, 128, 0, 8, 3, per_sm=2)),
    (1 << 62, KernelConfig("pt-128x128x128-w8", "tiles", 128, 128, 128, 0, 8, 3, per_sm=1)),
)
DEFAULT_CONFIGS: tuple[tuple[int, KernelConfig], ...] = (
    (8, KernelConfig("ct-default", "cuda-tiles")),
    (16, KernelConfig("cb-default", "cuda-bulk")),
    (32, _TILES_TRITON[1][1]),
    (1 << 62, KernelConfig("cw-default", "cuda-wgmma")),
)

#: What a CUDA GEMV config runs where the GEMV cannot (no NVRTC, fp16 activations, ROCm, a
#: CPU under the interpreter), by the layout it reads: the Triton row for M <= 16 of that
#: layout's table.
CUDA_FALLBACK = {"tiles": _TILES_TRITON[0][1], "fragment": FRAGMENT_CONFIGS[0][1]}

#: What a ``cuda-wgmma`` config runs where the wgmma GEMM cannot (not compute capability
#: 9.0, no NVRTC, fp16 activations): the Triton kernels of the tiles layout, by M.
WGMMA_FALLBACK = _TILES_TRITON

#: The table for K not a multiple of 32 (the fragment order groups 32 elements): the
#: repacked K-order kernels, the defaults before the fragment order (from
#: bench/results/nvfp4-sweep-repacked-h200.md): M <= 16 ``pr-16x64x256-p3``, M <= 64
#: ``pr-64x128x128``, larger M ``pr-128x128x64``.
K_ORDER_CONFIGS: tuple[tuple[int, KernelConfig], ...] = (
    (16, KernelConfig("pr-16x64x256-p3", "repacked", 16, 64, 256, 0, 4, 3, per_sm=7)),
    (64, KernelConfig("pr-64x128x128", "repacked", 64, 128, 128, 0, 4, 3)),
    (1 << 62, KernelConfig("pr-128x128x64", "repacked", 128, 128, 64, 0, 8, 3)),
)


def table_for(n: int, k: int, table: tuple[tuple[int, KernelConfig], ...] = DEFAULT_CONFIGS
              ) -> tuple[tuple[int, KernelConfig], ...]:
    """The M table a layer with ``n`` outputs and ``k`` inputs runs: ``table``, unless its
    layout cannot hold the layer: a tiles table needs N a multiple of 16 and K of 128
    (else ``FRAGMENT_CONFIGS``), a fragment table K a multiple of 32 (else
    ``K_ORDER_CONFIGS``)."""
    layout = table_layout(table)
    if layout == "tiles" and (n % 16 or k % 128):
        table, layout = FRAGMENT_CONFIGS, "fragment"
    if layout == "fragment" and k % 32:
        return K_ORDER_CONFIGS
    return table


#: The weight layouts: ``checkpoint`` (packed uint8 [N, K/2] as loaded), ``repacked``
#: (``kernelbay.formats.repack_e2m1_words``' int32 [N, K/8], K order ``"k"``) and ``fragment``
#: (the same words in the ``"fragment"`` K order, int32 [N, K/32, 4]; K a multiple of 32).
LAYOUTS = ("checkpoint", "repacked", "fragment", "tiles")

_LAYOUT_OF_PATH = {"repacked": "repacked", "fragment": "fragment", "cuda": "fragment",
                   "cuda-tiles": "tiles", "tiles": "tiles", "cuda-wgmma": "tiles",
                   "cuda-bulk": "tiles"}


def layout_of(config: KernelConfig) -> str:
    """The weight layout ``config``'s kernel reads."""
    return _LAYOUT_OF_PATH.get(config.path, "checkpoint")


def table_layout(table: tuple[tuple[int, KernelConfig], ...]) -> str:
    """The one weight layout every config of an M table reads (a method stores its weight
    once); ``ValueError`` naming the configs when a table mixes the two."""
    kinds = {layout_of(c) for _, c in table}
    if len(kinds) != 1:
        names = ", ".join(f"{c.name} ({layout_of(c)})" for _, c in table)
        raise ValueError(f"nvfp4-triton: an M table must read one weight layout of {LAYOUTS}; "
                         f"this one mixes them: {names}")
    return kinds.pop()


def _hw(name: str, block_m: int, block_n: int, block_k: int, warps: int, stages: int,
        split_k: int = 0) -> KernelConfig:
    return KernelConfig(name, "fused", block_m, block_n, block_k, split_k, warps, stages)


def _cuda(tm: int, wk: int, stages: int, min_blocks: int, tiled: bool, wn: int,
          early_release: bool = False) -> KernelConfig:
    """A CUDA GEMV candidate (its token tiles follow M, so the name leaves them out)."""
    kind, path = ("ct", "cuda-tiles") if tiled else ("cu", "cuda")
    return KernelConfig(f"{kind}-t{tm}w{wn}x{wk}s{stages}b{min_blocks}"
                        + ("e" if early_release else ""), path,
                        gemv=GemvConfig(tm, 1, wk, stages, min_blocks, tiled, wn,
                                        early_release))


#: Alternatives the benchmark tries per shape (``--configs all``); BLOCK_M is lowered to
#: cover M where a config's is larger than needed. The halfword kernels of the third H200
#: sweep (16-row tiles with K tiles of 256/512 for M <= 16, 64- and 128-row tiles above) and
#: ``dequant-cublas``. ``w8-16x64x256`` and the ``xpt-*`` kernels (second and third sweeps)
#: lost at every M and were removed with their kernels.
CANDIDATES: tuple[KernelConfig, ...] = (
    _hw("hw-16x64x512-s2", 16, 64, 512, 4, 4, split_k=2),
    _hw("hw-16x64x256", 16, 64, 256, 4, 4),
    _hw("hw-16x128x256", 16, 128, 256, 4, 4),
    # Fewer stages or more warps per program: Nsight Compute on hw-16x64x512-s2 (104 KB of
    # shared memory, two programs per SM) showed 1.9 warps per scheduler, idle 41% of cycles.
    _hw("hw-16x64x512-s2-p2", 16, 64, 512, 4, 2, split_k=2),
    _hw("hw-16x64x256-p2", 16, 64, 256, 4, 2),
    _hw("hw-16x64x256-p3", 16, 64, 256, 4, 3),
    _hw("hw-16x128x256-w8", 16, 128, 256, 8, 3),
    _hw("hw-16x64x128", 16, 64, 128, 4, 4),
    # Without the shared-memory pipeline (1 stage: loads straight to registers) and narrower
    # tiles: more programs per SM for the decode's dependent chains, the top stall in the
    # profile of the four-stage tile (bench/results/profiles/nvfp4-m16-h200-ncu.txt).
    _hw("hw-16x64x256-p1", 16, 64, 256, 4, 1),
    _hw("hw-16x64x128-p2", 16, 64, 128, 4, 2),
    _hw("hw-16x32x256-p3", 16, 32, 256, 4, 3),
    # The word decode (elements k and k + 4 in one register, no 16-bit packing): 4.8 SASS
    # instructions per element in the K loop against 6.2 for hw-16x64x256-p3.
    KernelConfig("pw-16x64x256-p3", "pairs", 16, 64, 256, 0, 4, 3),
    KernelConfig("pw-16x64x512-s2-p2", "pairs", 16, 64, 512, 2, 4, 2),
    KernelConfig("pw-64x128x128", "pairs", 64, 128, 128, 0, 4, 3),
    _hw("hw-64x128x128", 64, 128, 128, 4, 3),
    _hw("hw-128x128x64", 128, 128, 64, 8, 3),
    KernelConfig("dequant-cublas", "dequant"),
    # The CUDA GEMV (``cuda_gemv``): ``cu-*`` on the fragment layout, ``ct-*`` on the tiles
    # layout; ``ct-default`` is ``cuda_gemv.config_for_m``.
    KernelConfig("ct-default", "cuda-tiles"),
    *(_cuda(tm, wk, st, mb, tiled, wn) for tm, wk, st, mb, tiled, wn in (
          (2, 8, 4, 2, False, 1), (2, 4, 4, 4, False, 1), (4, 8, 4, 1, False, 1),
          (2, 8, 4, 2, True, 1), (2, 4, 4, 4, True, 1), (4, 8, 4, 1, True, 1),
          (1, 8, 6, 2, True, 1), (2, 16, 4, 1, True, 1), (4, 4, 4, 2, True, 1),
          (1, 2, 6, 2, True, 4), (1, 4, 4, 1, True, 4), (2, 2, 4, 2, True, 4),
          (2, 4, 4, 1, True, 2), (1, 4, 8, 1, True, 4), (2, 1, 6, 2, True, 8),
          # warps side by side over rows on large layers at 2-8 tokens (the rows sweep)
          (2, 2, 6, 2, True, 4), (2, 4, 4, 2, True, 2), (2, 1, 4, 2, True, 8),
          (4, 2, 4, 1, True, 4), (2, 2, 4, 1, True, 4), (1, 2, 4, 2, True, 8),
          (2, 2, 8, 2, True, 4), (2, 1, 6, 2, True, 4), (1, 4, 4, 2, True, 4))),
    # the default builds releasing the next programmatic launch at their start (``...e``;
    # differs only under programmatic launches, on unless KERNELBAY_PDL=0)
    *(_cuda(tm, wk, st, mb, True, wn, early_release=True) for tm, wk, st, mb, wn in (
          (2, 4, 4, 4, 1), (2, 8, 4, 2, 1), (2, 2, 4, 2, 4))),
    # The bulk-copy GEMV (``cuda_gemv_bulk``, sm_90) on the tiles layout: the default build
    # (one tile per CTA, eight warps over K) with the rule's split and fixed ones, and wider
    # CTAs (more rows sharing each stage's activations).
    KernelConfig("cb-default", "cuda-bulk"),
    *(KernelConfig(b.name, "cuda-bulk", bulk=b) for b in (
        BulkGemvConfig(), BulkGemvConfig(splits=1), BulkGemvConfig(splits=2),
        BulkGemvConfig(1, 2, 8, 1, 4), BulkGemvConfig(2, 1, 4, 1, 4),
        BulkGemvConfig(2, 2, 4, 1, 4), BulkGemvConfig(4, 2, 2, 1, 4),
        # wide CTAs of up to sixteen consumer warps for the large layers
        BulkGemvConfig(4, 2, 4, 1, 4), BulkGemvConfig(8, 2, 2, 1, 4),
        BulkGemvConfig(4, 4, 2, 1, 4), BulkGemvConfig(8, 1, 2, 1, 6),
        BulkGemvConfig(2, 2, 4, 1, 6), BulkGemvConfig(4, 1, 4, 1, 6),
        BulkGemvConfig(2, 2, 8, 1, 4), BulkGemvConfig(4, 2, 4, 1, 4, 1))),
    # The sm_90a wgmma GEMM (``cuda_wgmma``) on the tiles layout; ``cw-default`` is
    # ``cuda_wgmma.config_for_m``.
    KernelConfig("cw-default", "cuda-wgmma"),
    *(KernelConfig(c.name, "cuda-wgmma", wgmma=c) for c in (
        WgmmaConfig(2, 128, 4, 1), WgmmaConfig(2, 128, 5, 1), WgmmaConfig(1, 128, 3, 2),
        WgmmaConfig(1, 128, 4, 1), WgmmaConfig(1, 256, 3, 1), WgmmaConfig(1, 64, 4, 2),
        WgmmaConfig(2, 64, 4, 1), WgmmaConfig(4, 64, 4, 1),
        # split K (fp32 partials summed in split order) for the batches whose grid is small
        WgmmaConfig(1, 64, 4, 2, 2), WgmmaConfig(1, 64, 4, 2, 3), WgmmaConfig(1, 64, 4, 2, 4),
        WgmmaConfig(2, 64, 4, 1, 2), WgmmaConfig(2, 64, 4, 1, 4), WgmmaConfig(1, 128, 4, 1, 2),
        WgmmaConfig(2, 128, 4, 1, 2), WgmmaConfig(1, 16, 6, 3, 4), WgmmaConfig(1, 16, 6, 3, 8),
        # 256 tokens per warpgroup (half the decode per multiply-add), split where the grid
        # is small; 64 tokens at three CTAs per SM (more warps to hide the decode's latency)
        WgmmaConfig(2, 256, 3, 1), WgmmaConfig(2, 256, 3, 1, 2), WgmmaConfig(2, 256, 3, 1, 3),
        WgmmaConfig(1, 64, 3, 3, 2), WgmmaConfig(1, 64, 3, 3, 3), WgmmaConfig(1, 64, 3, 3, 4),
        # 64 tokens over 192 or 256 rows per CTA: the activations (64 tokens x 256 bytes per
        # chunk, from L2) are read once per CTA, so wider CTAs read fewer of them
        WgmmaConfig(4, 64, 4, 1, 2), WgmmaConfig(4, 64, 4, 1, 3), WgmmaConfig(4, 64, 4, 1, 4),
        WgmmaConfig(3, 64, 4, 1), WgmmaConfig(3, 64, 4, 1, 2), WgmmaConfig(3, 64, 4, 1, 3),
        # three and more stages for the 64-token build (with three, as many as the register
        # sets, every slot address is a constant in the loop)
        WgmmaConfig(4, 64, 3, 1), WgmmaConfig(4, 64, 3, 1, 4), WgmmaConfig(2, 128, 3, 1),
        WgmmaConfig(2, 128, 3, 1, 2),
        WgmmaConfig(4, 64, 5, 1), WgmmaConfig(4, 64, 6, 1), WgmmaConfig(4, 64, 5, 1, 4),
        WgmmaConfig(4, 64, 6, 1, 4),
        # 16 tokens: the Triton kernel's batch sizes, with 16 to 20 warps per SM
        WgmmaConfig(4, 16, 8, 1), WgmmaConfig(4, 16, 8, 1, 4), WgmmaConfig(2, 16, 8, 2, 4),
        WgmmaConfig(2, 16, 6, 2, 2), WgmmaConfig(2, 16, 6, 2, 4), WgmmaConfig(1, 16, 6, 4),
        WgmmaConfig(1, 16, 6, 4, 2), WgmmaConfig(1, 16, 6, 4, 4), WgmmaConfig(1, 16, 5, 5),
        WgmmaConfig(1, 16, 5, 5, 2), WgmmaConfig(1, 16, 5, 5, 4), WgmmaConfig(4, 16, 3, 1),
        WgmmaConfig(4, 16, 3, 1, 4), WgmmaConfig(2, 16, 3, 2, 4), WgmmaConfig(1, 16, 3, 4, 4),
        # the four-stage defaults in turns of three steps (slots computed per step), against
        # their turns of twelve (constant slots)
        WgmmaConfig(4, 64, 4, 1, 4, unroll=3), WgmmaConfig(4, 64, 4, 1, unroll=3),
        WgmmaConfig(2, 128, 4, 1, unroll=3), WgmmaConfig(2, 128, 4, 1, 2, unroll=3),
        # stream K: one CTA per SM over equal ranges of (row tile, chunk) units, for grids
        # that leave SMs idle or a partial last wave (within 2% of the defaults on the H200:
        # bench/results/nvfp4-sweep-wgmma-streamk-h200.md)
        WgmmaConfig(4, 64, 4, 1, stream_k=True), WgmmaConfig(2, 128, 4, 1, stream_k=True),
        WgmmaConfig(2, 256, 3, 1, stream_k=True))),
    # The repacked word layout (``kernelbay.formats.e2m1_words``): natural K order, no
    # activation permutation, no 16-bit repacking; the K loop of pr-16x128x128 has 4.3 SASS
    # instructions per element against 4.8 for pw-16x64x256-p3 (LOP3 128, shifts 96, no PRMT).
    KernelConfig("pr-16x128x128", "repacked", 16, 128, 128, 0, 4, 3),
    KernelConfig("pr-16x64x256-p3", "repacked", 16, 64, 256, 0, 4, 3),
    KernelConfig("pr-16x128x256", "repacked", 16, 128, 256, 0, 4, 3),
    KernelConfig("pr-16x64x512-s2-p2", "repacked", 16, 64, 512, 2, 4, 2),
    KernelConfig("pr-16x128x128-p4", "repacked", 16, 128, 128, 0, 4, 4),
    KernelConfig("pr-16x256x128", "repacked", 16, 256, 128, 0, 8, 3),
    KernelConfig("pr-64x128x128", "repacked", 64, 128, 128, 0, 4, 3),
    KernelConfig("pr-64x64x128", "repacked", 64, 64, 128, 0, 4, 3),
    KernelConfig("pr-64x128x64-p4", "repacked", 64, 128, 64, 0, 4, 4),
    KernelConfig("pr-128x128x64", "repacked", 128, 128, 64, 0, 8, 3),
    KernelConfig("pr-128x256x64", "repacked", 128, 256, 64, 0, 8, 3),
    # The transposed product on fragment-order words (``path="fragment"``): the decoded
    # weight is the register A operand of an sm_90 wgmma (BLOCK_N rows, 64 per warpgroup),
    # the activations its shared-memory B operand as loaded (no fragment moves, no ldmatrix
    # reorder), and no shared-memory round trip of the decoded tile at any M.
    KernelConfig("pf-16x64x256-p3", "fragment", 16, 64, 256, 0, 4, 3, per_sm=7),
    KernelConfig("pf-16x64x256-p4", "fragment", 16, 64, 256, 0, 4, 4, per_sm=7),
    KernelConfig("pf-16x128x256", "fragment", 16, 128, 256, 0, 4, 3, per_sm=7),
    KernelConfig("pf-16x128x128-p4", "fragment", 16, 128, 128, 0, 4, 4, per_sm=7),
    KernelConfig("pf-16x64x512-p2", "fragment", 16, 64, 512, 0, 4, 2, per_sm=7),
    KernelConfig("pf-16x128x256-w8", "fragment", 16, 128, 256, 0, 8, 3, per_sm=7),
    KernelConfig("pf-64x128x128", "fragment", 64, 128, 128, 0, 4, 3),
    KernelConfig("pf-64x64x256", "fragment", 64, 64, 256, 0, 4, 3),
    KernelConfig("pf-64x128x128-w8", "fragment", 64, 128, 128, 0, 8, 3, per_sm=2),
    KernelConfig("pf-64x256x64-w8", "fragment", 64, 256, 64, 0, 8, 4),
    KernelConfig("pf-128x128x64-w8", "fragment", 128, 128, 64, 0, 8, 3),
    KernelConfig("pf-128x128x128-w8", "fragment", 128, 128, 128, 0, 8, 3, per_sm=1),
    KernelConfig("pf-128x256x64-w8", "fragment", 128, 256, 64, 0, 8, 3),
    KernelConfig("pf-256x128x64-w8", "fragment", 256, 128, 64, 0, 8, 3),
    # The same kernels on the tiles layout (``pt-*``: each 16-row tile's chunks contiguous).
    KernelConfig("pt-16x64x256-p3", "tiles", 16, 64, 256, 0, 4, 3, per_sm=7),
    KernelConfig("pt-16x64x256-p4", "tiles", 16, 64, 256, 0, 4, 4, per_sm=7),
    KernelConfig("pt-16x128x256", "tiles", 16, 128, 256, 0, 4, 3, per_sm=7),
    KernelConfig("pt-64x128x128-w8", "tiles", 64, 128, 128, 0, 8, 3, per_sm=2),
    KernelConfig("pt-64x64x256", "tiles", 64, 64, 256, 0, 4, 3),
    KernelConfig("pt-128x128x128-w8", "tiles", 128, 128, 128, 0, 8, 3, per_sm=1),
    KernelConfig("pt-128x256x64-w8", "tiles", 128, 256, 64, 0, 8, 3),
    *(KernelConfig(f"pt-16x64x256-p3-s{s}", "tiles", 16, 64, 256, s, 4, 3) for s in (2, 3, 6)),
    # Fixed splits of the fragment defaults (the split rule's choice is timed as the plain name)
    *(KernelConfig(f"pf-16x64x256-p3-s{s}", "fragment", 16, 64, 256, s, 4, 3)
      for s in (2, 3, 5, 6, 8)),
    *(KernelConfig(f"pf-128x128x128-w8-s{s}", "fragment", 128, 128, 128, s, 8, 3)
      for s in (1, 2, 4, 6)),
    *(KernelConfig(f"pf-64x128x128-w8-s{s}", "fragment", 64, 128, 128, s, 8, 3)
      for s in (1, 2, 4)),
    # Fixed splits of the M <= 16 default (any count: a shorter last split stops early): the
    # rule's power of two leaves 512 programs for 660 resident slots at N = 8192 (Nsight
    # Compute: 0.78 waves, 3.3 warps per scheduler).
    *(KernelConfig(f"pr-16x64x256-p3-s{s}", "repacked", 16, 64, 256, s, 4, 3)
      for s in (2, 3, 5, 6, 7, 8)),
)



def serving_name(config: KernelConfig, m: int, n: int, k: int, sms: int, bulk_ok: bool) -> str:
    """The kernel that serves ``config`` at batch ``m`` for an ``n`` x ``k`` layer (for
    tables): a ``cuda-bulk`` config names its fallback where ``cuda_gemv_bulk.config_for``
    picks no build, and both GEMV defaults name the bulk build they run (``bulk_ok``: a GPU of
    compute capability >= 9.0)."""
    from kernelbay_quant_nvfp4.cuda_gemv_bulk import config_for as bulk_config_for

    if config.path == "cuda-bulk" or (config.path == "cuda-tiles" and config.gemv is None):
        build = (config.bulk or bulk_config_for(m, n, k, sms)) if bulk_ok and m <= 16 else None
        if build is not None:
            return f"{config.name} ({build.name})" if config.bulk is None else config.name
        if config.path == "cuda-bulk":
            return CUDA_FALLBACK["tiles"].name
    return config.name


def config_for(m: int, table: tuple[tuple[int, KernelConfig], ...] = DEFAULT_CONFIGS
               ) -> KernelConfig:
    """The configuration serving batch size ``m``."""
    for largest, config in table:
        if m <= largest:
            return config
    return table[-1][1]


def split_k_for(config: KernelConfig, m: int, n: int, k: int, sms: int) -> int:
    """``config.split_k`` when set, else the largest power of two that keeps the grid at or
    below ``config.per_sm`` programs per SM, with at least two K tiles per split.

    The M <= 16 default aims for 7 (the H200 sweep with fixed splits,
    ``bench/results/nvfp4-sweep-splits-h200.md``): five of its programs are resident per SM
    (96 registers, 35 KB of shared memory), and N = 28672 ran 9-13% faster split in two (896
    programs) than whole (448, a third of the slots idle), while N = 8192 stays at four
    splits (eight lost up to 6%)."""
    if config.split_k:
        return config.split_k
    ctas = -(-m // config.block_m) * -(-n // config.block_n)
    k_tiles = -(-k // config.block_k)
    split = 1
    while ctas * split * 2 <= config.per_sm * sms and k_tiles // (split * 2) >= 2:
        split *= 2
    return split


def fit_block_m(config: KernelConfig, m: int) -> KernelConfig:
    """``config`` with BLOCK_M no larger than needed for ``m`` rows (at least 16)."""
    want = 16
    while want < m and want < config.block_m:
        want *= 2
    return replace(config, block_m=min(config.block_m, want))
