"""``nvfp4-triton``: weight-only NVFP4 linear with the weight decoded in registers (Triton).

Math: ``y = x @ W^T (+ b)`` with ``W[n, k] = e2m1(code[n, k]) * float(scale[n, k // 16]) *
weight_scale_2``, each weight element rounded to the activation dtype (bf16/fp16) before the
tensor-core product, accumulated in fp32 (``triton_halfword``, ``triton_kernels``). For W4A4 checkpoints
(``nvfp4-dynamic``) this is the weight-only reading FORMATS.md gives for Hopper and older:
``input_scale`` is not used.

Paths by batch size M (``triton_configs``): split-K GEMV tiles for M <= 16, tiled kernel for
larger M, and for the largest M either larger tiles or a Triton dequantize into a per-call
temporary followed by ``F.linear`` (cuBLAS). No dense copy of the weight is kept.
"""

from __future__ import annotations

import functools
import importlib.util
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, ClassVar, cast

from kernelbay.layers.linear import LinearMethod, TensorSpec
from kernelbay.requests import LinearRequest
from kernelbay.verdict import Verdict

from kernelbay_quant_nvfp4.cuda_gemv import device_index, sm_count, stored_rows
from kernelbay_quant_nvfp4.schemes import (
    NVFP4_BLOCK,
    W4A4_ACTIVATION,
    dense_only,
    k_in_blocks,
    nvfp4_layer_checks,
)
from kernelbay_quant_nvfp4.triton_configs import (
    CUDA_FALLBACK,
    DEFAULT_CONFIGS,
    LAYOUTS,
    WGMMA_FALLBACK,
    KernelConfig,
    config_for,
    fit_block_m,
    layout_of,
    split_k_for,
    table_for,
    table_layout,
)

if TYPE_CHECKING:
    import torch
    from kernelbay.device import DeviceCapability

    from kernelbay_quant_nvfp4.cuda_gemv_bulk import BulkGemvConfig

__all__ = ["Nvfp4TritonLinear", "check_finite_scales", "checkpoint_tensors", "fragment_of_tiles",
           "gpu_triton_checks", "layout_tensors", "run_config", "stored_tensors",
           "tiles_of_fragment"]

_ACT_DTYPES = ("bfloat16", "float16")


def gpu_triton_checks(device: DeviceCapability) -> Verdict:
    """Accept a CUDA device of compute capability >= 8.0 or a ROCm device, with triton
    installed (looked up, not imported)."""
    if device.platform == "cuda":
        gpu = Verdict.check(device.cc_at_least(8, 0),
                            f"needs a CUDA device of compute capability >= 8.0 for the Triton "
                            f"kernel's bf16/fp16 tensor-core dots, device has {device.cc_text}")
    else:
        gpu = Verdict.check(device.platform == "rocm",
                            f"needs a CUDA (compute capability >= 8.0) or ROCm GPU for Triton, "
                            f"device is {device.platform} {device.arch}")
    return Verdict.all(gpu, Verdict.check(importlib.util.find_spec("triton") is not None,
                                          "needs the triton package, which is not installed "
                                          "(pip install triton)"))


def check_finite_scales(method: str, scales: torch.Tensor, global_scale: torch.Tensor,
                        prefix: str = "") -> None:
    """Raise ``ValueError`` naming the tensor when a block scale or the global scale is NaN
    or infinite (a kernel would silently spread it over a whole block or tensor)."""
    import torch

    bad = int((~torch.isfinite(scales.float())).sum())
    if bad:
        raise ValueError(f"{method}: {prefix}weight_scale has {bad} NaN/Inf block scale(s) of "
                         f"{scales.numel()}; NVFP4 block scales must be finite E4M3")
    if not bool(torch.isfinite(global_scale.float()).all()):
        raise ValueError(f"{method}: {prefix}weight_scale_2 is {global_scale.float().item()}; "
                         "the NVFP4 global scale must be a finite fp32 value")


@functools.cache
def _cc_major(index: int) -> int:
    import torch

    return int(torch.cuda.get_device_capability(index)[0])


def layout_tensors(packed: torch.Tensor, scales: torch.Tensor, layout: str
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The checkpoint's weight (uint8 [..., N, K/2]) and E4M3 block scales [..., N, K/16] in
    weight ``layout`` (``triton_configs.LAYOUTS``):

    * ``checkpoint``: as loaded;
    * ``repacked``: ``kernelbay.formats.repack_e2m1_words``' int32 [..., N, K/8], the scales
      as loaded;
    * ``fragment``: the scales' signs and zeros folded into the codes and the scales stored as
      uint8 codes (``scale_codes.fold_block_scales``), the words in the ``"fragment"`` K order
      (int32 [..., N, K/32, 4]; K a multiple of 32);
    * ``tiles``: the fragment words and codes regrouped so that each 16-row tile's
      128-element chunks follow each other (``tiles_of_fragment``; N a multiple of 16, K of
      128): a GEMV reads one contiguous stream per tile.

    Rows are independent, so stacked experts convert as one matrix."""
    if layout not in LAYOUTS:
        raise ValueError(f"nvfp4-triton: weight layout {layout!r}; valid: {LAYOUTS}")
    if layout == "checkpoint":
        return packed.contiguous(), scales.contiguous()
    from kernelbay.formats.e2m1_words import repack_e2m1_words

    if layout == "tiles":
        words, codes = layout_tensors(packed, scales, "fragment")
        return tiles_of_fragment(words, codes)
    if layout == "fragment":
        from kernelbay_quant_nvfp4.scale_codes import fold_block_scales

        packed, scales = fold_block_scales(packed, scales)
    lead = packed.shape[:-1]
    words = repack_e2m1_words(packed.contiguous().reshape(-1, packed.shape[-1]),
                              "fragment" if layout == "fragment" else "k")
    return words.reshape(*lead, *words.shape[1:]), scales.contiguous()


def tiles_of_fragment(words: torch.Tensor, codes: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Fragment-layout words int32 [..., N, K/32, 4] and scale codes uint8 [..., N, K/16] ->
    the ``tiles`` layout: words int32 [..., N/16, K/128, 256] (per 16-row tile and
    128-element chunk: rows 0-7 then 8-15, each row's four groups of four words) and codes
    uint8 [..., N/16, K/128, 128] (the same rows, eight codes each). ``ValueError`` unless N is
    a multiple of 16 and K of 128."""
    n, groups = words.shape[-3], words.shape[-2]
    if n % 16 or groups % 4 or words.shape[-1] != 4 or tuple(codes.shape[-2:]) != (n, 2 * groups):
        raise ValueError(f"nvfp4-triton: the tiles layout needs fragment words [N, K/32, 4] "
                         f"and codes [N, K/16] with N a multiple of 16 and K of 128, got "
                         f"{tuple(words.shape)} and {tuple(codes.shape)}")
    lead = words.shape[:-3]
    chunks = groups // 4
    w = words.reshape(-1, n // 16, 16, chunks, 16).transpose(2, 3)
    c = codes.reshape(-1, n // 16, 16, chunks, 8).transpose(2, 3)
    return (w.reshape(*lead, n // 16, chunks, 256).contiguous(),
            c.reshape(*lead, n // 16, chunks, 128).contiguous())


def fragment_of_tiles(words: torch.Tensor, codes: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``tiles_of_fragment``."""
    tiles, chunks = words.shape[-3], words.shape[-2]
    lead = words.shape[:-3]
    w = words.reshape(-1, tiles, chunks, 16, 16).transpose(2, 3)
    c = codes.reshape(-1, tiles, chunks, 16, 8).transpose(2, 3)
    return (w.reshape(*lead, tiles * 16, chunks * 4, 4).contiguous(),
            c.reshape(*lead, tiles * 16, chunks * 8).contiguous())


def stored_tensors(packed: torch.Tensor, scales: torch.Tensor,
                   table: tuple[tuple[int, KernelConfig], ...]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The checkpoint's weight and block scales in the layout ``table``'s kernels read
    (``layout_tensors``). No wait for the layout kernels: the CUDA kernels copy their weight
    before their grid wait only as programmatic dependents, and those only ever follow a GEMM
    or split-K sum of ours (``cuda_jit.programmatic_dependent``), never a kernel that writes
    a weight."""
    return layout_tensors(packed, scales, table_layout(table))


def _layout_text(weight: torch.Tensor, scales: torch.Tensor) -> str:
    """Which of ``LAYOUTS`` a stored weight and its scales are in, from dtypes and shapes
    (the words' order from ``kernelbay.formats.words_order``)."""
    import torch
    from kernelbay.formats import words_order

    e4m3 = scales.dtype == torch.float8_e4m3fn
    if weight.dtype == torch.uint8 and weight.dim() == 2 and e4m3:
        return "checkpoint"
    if weight.dtype == torch.int32 and weight.dim() == 3 and weight.shape[-1] == 256 \
            and scales.dtype == torch.uint8 and scales.dim() == 3 and scales.shape[-1] == 128:
        return "tiles"
    try:
        order = words_order(weight)
    except ValueError:
        return f"none of {LAYOUTS}"
    if order == "k" and e4m3:
        return "repacked"
    if order == "fragment" and scales.dtype == torch.uint8:
        return "fragment"
    return f"none of {LAYOUTS}"


def checkpoint_tensors(weight: torch.Tensor, scales: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """A stored weight and its scales (any of ``LAYOUTS``, ``layout_tensors``) as checkpoint
    uint8 [N, K/2] codes and E4M3 scales that dequantize through the reference to the same
    values (for ``fragment``: with the folded signs and zeros)."""
    from kernelbay.formats import checkpoint_layout

    if _layout_text(weight, scales) == "tiles":
        weight, scales = fragment_of_tiles(weight, scales)
    if _layout_text(weight, scales) == "fragment":
        from kernelbay_quant_nvfp4.scale_codes import codes_to_e4m3

        scales = codes_to_e4m3(scales)
    return checkpoint_layout(weight), scales


def run_config(config: KernelConfig, x2: torch.Tensor, packed: torch.Tensor,
               scales: torch.Tensor, global_scale: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
    """``x2 [M, K]`` through one kernel configuration (the benchmark calls it directly).
    ``packed`` and ``scales``: in the layout the config reads (``layout_of``,
    ``layout_tensors``)."""
    import torch.nn.functional as F

    from kernelbay_quant_nvfp4.triton_halfword import nvfp4_linear_hw
    from kernelbay_quant_nvfp4.triton_kernels import dequantize_nvfp4_triton

    found = _layout_text(packed, scales)
    if found != layout_of(config):
        raise ValueError(f"nvfp4-triton: config {config.name} reads the {layout_of(config)} "
                         f"weight layout, got a {packed.dtype} weight {tuple(packed.shape)} "
                         f"with {scales.dtype} scales ({found}); layouts (weight, scales): "
                         "checkpoint (uint8 [N, K/2], E4M3), repacked (int32 [N, K/8], E4M3), "
                         "fragment (int32 [N, K/32, 4], uint8 codes), tiles (int32 "
                         "[N/16, K/128, 256], uint8 codes [N/16, K/128, 128])")
    m, k = x2.shape
    if config.path in ("cuda", "cuda-tiles"):
        out = _run_cuda(config, x2, packed, scales, global_scale, bias)
        if out is not None:
            return out
        config = CUDA_FALLBACK[layout_of(config)]
    if config.path == "cuda-bulk":
        sms = sm_count(device_index(x2)) if x2.is_cuda else 132
        out = None
        if m <= 16 and cuda_gemv_reason(x2, packed, scales, True) is None:
            out = _run_bulk(x2, packed, scales, global_scale, bias, sms, config.bulk)
        if out is not None:
            return out
        config = CUDA_FALLBACK["tiles"]
    if config.path == "cuda-wgmma":
        out = _run_wgmma(config, x2, packed, scales, global_scale, bias)
        if out is not None:
            return out
        config = config_for(m, WGMMA_FALLBACK)
    if config.path == "dequant":
        # A per-call temporary: the caching allocator hands the same block back next call,
        # so no dense copy lives between calls.
        weight = dequantize_nvfp4_triton(packed, scales, global_scale, x2.dtype)
        return F.linear(x2, weight, bias)
    config = fit_block_m(config, m)
    sms = sm_count(device_index(x2)) if x2.is_cuda else 4
    return nvfp4_linear_hw(x2, packed, scales, global_scale, bias, block_m=config.block_m,
                           block_n=config.block_n, block_k=config.block_k,
                           split_k=split_k_for(config, m,
                                               stored_rows(packed, layout_of(config) == "tiles"),
                                               k, sms),
                           num_warps=config.num_warps, num_stages=config.num_stages,
                           pairs=config.path == "pairs", repacked=config.path == "repacked",
                           fragment=config.path == "fragment", tiled=config.path == "tiles")


def cuda_gemv_reason(x2: torch.Tensor, words: torch.Tensor, codes: torch.Tensor,
                     tiled: bool = True) -> str | None:
    """Why the CUDA GEMV (``cuda_gemv``) cannot take these operands, NVRTC included
    (``None``: it can)."""
    from kernelbay.cuda_jit import nvrtc_available

    from kernelbay_quant_nvfp4.cuda_gemv import gemv_unsupported

    reason = gemv_unsupported(x2, words, codes, tiled)
    if reason is None and not nvrtc_available():
        reason = "NVRTC (libnvrtc, part of CUDA builds of torch) was not found"
    return reason


def cuda_wgmma_reason(x2: torch.Tensor, words: torch.Tensor,
                      codes: torch.Tensor) -> str | None:
    """Why the sm_90a wgmma GEMM (``cuda_wgmma``) cannot take these operands, NVRTC included
    (``None``: it can)."""
    from kernelbay.cuda_jit import nvrtc_available

    from kernelbay_quant_nvfp4.cuda_wgmma import wgmma_unsupported

    reason = wgmma_unsupported(x2, words, codes)
    if reason is None and not nvrtc_available():
        reason = "NVRTC (libnvrtc, part of CUDA builds of torch) was not found"
    return reason


def _run_wgmma(config: KernelConfig, x2: torch.Tensor, words: torch.Tensor,
               codes: torch.Tensor, global_scale: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor | None:
    """``x2`` through the wgmma GEMM; ``None`` when ``cuda_wgmma_reason`` says it cannot
    run, when the default build would leave SMs idle (``cuda_wgmma.prefers``; a config naming
    its build always runs it), or when its build or load fails (then it is off on the device
    for good, with one warning)."""
    from kernelbay.cuda_jit import CudaJitError

    from kernelbay_quant_nvfp4.cuda_wgmma import (
        config_for_m,
        launch_wgmma,
        mark_broken,
        prefers,
        wgmma_kernel,
    )

    if cuda_wgmma_reason(x2, words, codes) is not None:
        return None
    m, n = x2.shape[0], words.shape[0] * 16
    sms = sm_count(device_index(x2))
    if config.wgmma is None and not prefers(m, n, x2.shape[1], sms):
        return None
    build = config.wgmma or config_for_m(m, n, x2.shape[1], sms)
    try:   # only building and loading turn it off; a failed launch is an error
        wgmma_kernel(build, device_index(x2))
    except CudaJitError as exc:
        _turn_off("CUDA wgmma GEMM", mark_broken, x2, exc)
        return None
    return launch_wgmma(x2, words, codes, global_scale, bias, build)


def _turn_off(kernel: str, mark_broken: Callable[[int, str], None], x2: torch.Tensor,
              exc: Exception, instead: str = "the Triton kernel") -> None:
    """A CUDA kernel's build or load failed: it is off on this device for good (one
    warning), and the caller runs ``instead`` on the same stored weight."""
    device = device_index(x2)
    mark_broken(device, str(exc).splitlines()[0])
    warnings.warn(f"nvfp4-triton: the {kernel} is off on cuda:{device} ({exc}); {instead} "
                  "serves its batch sizes", RuntimeWarning, stacklevel=3)


def _run_cuda(config: KernelConfig, x2: torch.Tensor, words: torch.Tensor,
              codes: torch.Tensor, global_scale: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor | None:
    """``x2`` through the CUDA GEMV in slices of its token tiles (M <= 16 is one launch);
    ``None`` when ``cuda_gemv_reason`` (for the first slice) says it cannot run."""
    from dataclasses import replace

    import torch
    from kernelbay.cuda_jit import CudaJitError, programmatic_launch

    from kernelbay_quant_nvfp4.cuda_gemv import (
        config_for_m,
        gemv_kernel,
        launch_gemv,
        mark_broken,
    )

    rows = min(x2.shape[0], 16)
    tiled = config.path == "cuda-tiles"
    if cuda_gemv_reason(x2[:rows], words, codes, tiled) is not None:
        return None
    sms = sm_count(device_index(x2)) if x2.is_cuda else 132
    if tiled and x2.shape[0] <= 16 and config.gemv is None:
        out = _run_bulk(x2, words, codes, global_scale, bias, sms)
        if out is not None:
            return out
    build = config.gemv or config_for_m(rows, stored_rows(words, tiled), x2.shape[1], sms,
                                        programmatic=programmatic_launch(device_index(x2)))
    parts = [x2[start:start + rows] for start in range(0, x2.shape[0], rows)]
    builds = [replace(build, nt=1 if part.shape[0] <= 8 else 2, tiled=tiled) for part in parts]
    try:   # only building and loading turn it off; a failed launch is an error
        for b in set(builds):
            gemv_kernel(b, device_index(x2))
    except CudaJitError as exc:
        _turn_off("CUDA GEMV", mark_broken, x2, exc)
        return None
    outs = [launch_gemv(part, words, codes, global_scale, bias, b)
            for part, b in zip(parts, builds, strict=True)]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _run_bulk(x2: torch.Tensor, words: torch.Tensor, codes: torch.Tensor,
              global_scale: torch.Tensor, bias: torch.Tensor | None, sms: int,
              build: BulkGemvConfig | None = None) -> torch.Tensor | None:
    """``x2`` (M <= 16, checked by ``cuda_gemv_reason``) through the bulk-copy GEMV of
    ``cuda_gemv_bulk`` on compute capability >= 9.0: ``build`` (its token tiles and stages
    fitted to M), else the build its rule picks (at most one 16-row tile per SM); ``None``
    where it does not run, or did not build (then it is off on the device and the per-lane
    GEMV serves the layer)."""
    from kernelbay.cuda_jit import CudaJitError

    from kernelbay_quant_nvfp4 import cuda_gemv_bulk as bulk

    if not x2.is_cuda:
        return None
    device = device_index(x2)
    if _cc_major(device) < 9 or bulk.broken_reason(device):
        return None
    if build is not None:
        build = bulk.fit_tokens(build, x2.shape[0]).resolved(stored_rows(words, True),
                                                             x2.shape[1], sms)
    else:
        build = bulk.config_for(x2.shape[0], stored_rows(words, True), x2.shape[1], sms)
    if build is None:
        return None
    try:   # only building and loading turn it off; a failed launch is an error
        bulk.bulk_kernel(build, device)
    except CudaJitError as exc:
        _turn_off("bulk-copy GEMV", bulk.mark_broken, x2, exc, "the per-lane GEMV")
        return None
    return bulk.launch_bulk(x2, words, codes, global_scale, bias, build, sms)


def kernel_plan(request: LinearRequest, device: DeviceCapability,
                table: tuple[tuple[int, KernelConfig], ...] = DEFAULT_CONFIGS) -> str:
    """Which kernel serves which batch size for this layer on ``device`` (a note for
    ``explain --verbose``): the M table ``table_for`` gives the layer, and whether its CUDA
    kernels can be built here (the device they need, bf16 activations, NVRTC found on this
    machine)."""
    from kernelbay.cuda_jit import find_nvrtc

    def cuda_why_not(device_ok: bool, device_why: str) -> str:
        """Why a CUDA kernel cannot serve the layer here ("": it can)."""
        if not device_ok:
            return device_why
        if request.activation_dtype != "bfloat16":
            return f"{request.activation_dtype} activations"
        return "no NVRTC on this machine" if find_nvrtc() is None else ""

    rows = table_for(request.out_features, request.in_features, table)
    parts = []
    above = 0   # the largest M of the row before
    for largest, config in rows:
        text = config.name
        if config.path in ("cuda", "cuda-tiles"):
            why = cuda_why_not(device.platform == "cuda" and device.cc_at_least(8, 0),
                               f"not on {device.platform} {device.arch}")
            fallback = CUDA_FALLBACK[layout_of(config)].name
            # cuda_gemv_bulk.config_for: at most one 16-row tile per SM
            bulk = (f"; the bulk-copy build on GPUs of at least "
                    f"{-(-request.out_features // 16)} SMs"
                    if config.gemv is None and device.cc_at_least(9, 0) else "")
            text = (f"CUDA GEMV ({config.name}, NVRTC{bulk})" if not why
                    else f"{fallback} (the CUDA GEMV: {why})")
        elif config.path == "cuda-bulk":
            why = cuda_why_not(device.platform == "cuda" and device.cc_at_least(9, 0),
                               f"needs compute capability >= 9.0, not {device.platform} "
                               f"{device.arch}")
            fallback = CUDA_FALLBACK["tiles"].name
            text = (f"bulk-copy CUDA GEMV ({config.name}, NVRTC) where its CTAs fit one per "
                    f"SM, else {fallback}" if not why
                    else f"{fallback} (the bulk-copy CUDA GEMV: {why})")
        elif config.path == "cuda-wgmma":
            why = cuda_why_not(device.platform == "cuda" and device.compute_capability == (9, 0),
                               f"needs compute capability 9.0, not {device.platform} "
                               f"{device.arch}")
            # the Triton rows this row's batch sizes fall back to
            under = [(b, c.name) for b, c in WGMMA_FALLBACK if b > above]
            fallback = " / ".join(name if i == len(under) - 1 else f"{name} up to M = {b}"
                                  for i, (b, name) in enumerate(under))
            text = (f"CUDA wgmma GEMM ({config.name}, NVRTC, sm_90a) where its grid fills the "
                    f"GPU, else {fallback}" if not why
                    else f"{fallback} (the CUDA wgmma GEMM: {why})")
        bound = "larger M" if largest >= 1 << 62 else f"M <= {largest}"
        parts.append(f"{bound}: {text}")
        above = largest
    return f"kernels by batch ({table_layout(rows)} layout): " + ", ".join(parts)


class Nvfp4TritonLinear(LinearMethod):
    """Weight-only NVFP4 on GPUs through Triton: packed E2M1 and E4M3 block scales decoded in
    registers, bf16/fp16 tensor-core dots; split-K for decode batches."""

    name: ClassVar[str] = "nvfp4-triton"
    api_version: ClassVar[str] = "1.0"
    priority: ClassVar[int] = 30
    summary: ClassVar[str] = ("NVFP4 weight-only (W4A16) Triton kernel, weight decoded in "
                              "registers; CUDA cc >= 8.0 / ROCm")
    #: The M -> config table ``apply`` uses (a class attribute, so it can be swapped to tune).
    configs: ClassVar[tuple[tuple[int, KernelConfig], ...]] = DEFAULT_CONFIGS

    @classmethod
    def can_implement(cls, request: LinearRequest, device: DeviceCapability) -> Verdict:
        s = request.scheme
        verdict = Verdict.all(
            dense_only(request),
            nvfp4_layer_checks(s, "weights", f"runs weight-only NVFP4 (activations None, or "
                                              f"{W4A4_ACTIVATION!r} read as weight-only)"),
            gpu_triton_checks(device),
            Verdict.check(request.activation_dtype in _ACT_DTYPES,
                          f"needs activation dtype in {_ACT_DTYPES} for the tensor-core dot, "
                          f"request has {request.activation_dtype!r}"),
            k_in_blocks(request),
        )
        if not verdict.accepted:
            return verdict
        notes = [kernel_plan(request, device, cls.configs)]
        if s.activation is not None:
            notes.append("weight-only: the checkpoint's input_scale is not used (activations "
                         "stay in their dtype)")
        return Verdict.accept(*notes)

    def table(self) -> tuple[tuple[int, KernelConfig], ...]:
        """The M table this layer runs (``table_for`` its input features)."""
        return table_for(self.request.out_features, self.request.in_features, self.configs)

    def tensor_specs(self) -> Mapping[str, TensorSpec]:
        r = self.request
        n, k = r.out_features, r.in_features
        weight_dim = self.weight_shard_dim
        # can_implement checks that this rank's K is whole NVFP4 blocks, so the block scales
        # always split with the weight (never the replicated case of tp.block_scale_sharding).
        specs = {
            "weight": TensorSpec((n, k // 2), "uint8", weight_dim),
            "weight_scale": TensorSpec((n, k // NVFP4_BLOCK), "float8_e4m3fn", weight_dim),
            "weight_scale_2": TensorSpec((), "float32", None),
            **self.bias_specs(),
        }
        if r.scheme.activation is not None:
            # W4A4 exports carry it; the weight-only math does not read it.
            specs["input_scale"] = TensorSpec((), "float32", None, required=False)
        return specs

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Check the scales, store the weight and block scales in the layout this layer's M
        table reads (``stored_tensors``: fragment-order words and scale codes for the default
        table when K is a multiple of 32), keep the global scale as a one-element fp32
        tensor on the weight's device (the kernels load it)."""
        weight = cast("torch.Tensor", layer.weight)
        scales = cast("torch.Tensor", layer.weight_scale)
        glob = cast("torch.Tensor", layer.weight_scale_2)
        check_finite_scales(self.name, scales.data, glob.data)
        layer.weight.data, layer.weight_scale.data = stored_tensors(weight.data, scales.data,
                                                                    self.table())
        layer.weight_scale_2.data = glob.data.float().reshape(1).to(weight.device)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        k = self.request.in_features
        lead = x.shape[:-1]
        x2 = x.reshape(-1, k)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        n = self.request.out_features
        if x2.shape[0] == 0:
            return x.new_empty(*lead, n)
        config = config_for(x2.shape[0], self.table())
        out = run_config(config, x2, cast("torch.Tensor", layer.weight),
                         cast("torch.Tensor", layer.weight_scale),
                         cast("torch.Tensor", layer.weight_scale_2), self.rank_bias(layer))
        return out.reshape(*lead, n)

    def dequantized_weight(self, layer: torch.nn.Module) -> torch.Tensor:
        """The dense weight in the activation dtype, through the reference (exact)."""
        import torch
        from kernelbay.formats import dequantize_nvfp4

        packed, scales = checkpoint_tensors(cast("torch.Tensor", layer.weight),
                                            cast("torch.Tensor", layer.weight_scale))
        w = dequantize_nvfp4(packed, scales,
                             cast("torch.Tensor", layer.weight_scale_2).reshape(()))
        return w.to(getattr(torch, self.request.activation_dtype))
