"""Host side of the Triton MLA kernels: launch shapes, split counts, per-token tables.

``mla_decode`` has the signature and results of ``mla.mla_attention`` (the reference);
``mla_write`` those of the reference ``write_kv``. Imports triton (only when used).
"""

from __future__ import annotations

import functools
import importlib
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import triton
import triton.language as tl
from kernelbay import triton_pdl
from kernelbay.layers import AttentionMetadata
from torch import Tensor

from kernelbay_attn_flashmla import triton_kernels
from kernelbay_attn_flashmla.records import MLARecord

__all__ = ["KERNELS", "KernelFields", "choose_splits", "combine_blocks", "default_block_n", "default_l2_ahead",
           "default_warps", "device_programs_per_sm", "kernel_fields", "last_kernel",
           "last_splits", "launch_constants", "mla_decode", "mla_write", "programs_per_sm",
           "resident_programs", "split_cost"]

#: Record kind -> (KIND, nope scale mode, rope scale mode): 0 bf16, 1 fp32 group scales,
#: 2 E8M0 group scales.
_MODES = {"bf16": (0, 0, 0), "fp8": (1, 1, 0), "fp8-e8m0": (2, 2, 0), "mxfp8": (3, 2, 2)}
#: Fewest keys a split should get: below this the combine costs more than the split saves.
MIN_SPLIT_KEYS = 256
#: Most splits per query token (the combine reads one partial per split).
MAX_SPLITS = 128
#: Nope columns per batched-dot chunk (one warp's share of the latent width).
NOPE_CHUNK = 64
#: Tiles ahead of the one computed on whose records each decode iteration asks L2 for (GPU),
#: quantized records (bf16 records: none, see ``default_l2_ahead``).
L2_AHEAD = 4
#: Decode programs one SM holds when the compiled kernel's resources are not known (the
#: interpreter; sm_90 builds of the wide-latent kernels take 200-255 registers).
DEFAULT_RESIDENT = 2


@dataclass(frozen=True)
class KernelFields:
    """A record's field offsets and scale modes as the kernels take them."""

    kind: int
    nope_off: int
    rope_off: int
    scale_off: int
    group: int
    nope_scale: int
    rope_scale: int


def kernel_fields(record: MLARecord) -> KernelFields:
    """The kernels' view of ``record`` (offsets from the descriptor, never literals)."""
    if record.kind not in _MODES:
        raise ValueError(f"no Triton kernel for record kind {record.kind!r}; kinds: "
                         f"{sorted(_MODES)}")
    kind, nope_scale, rope_scale = _MODES[record.kind]
    group = record.group_size or 1
    if record.kind == "bf16":
        return KernelFields(kind, record.field("nope").offset, record.field("rope").offset, 0,
                            group, nope_scale, rope_scale)
    if record.kind == "mxfp8":
        values = record.field("values")
        return KernelFields(kind, values.offset, values.offset + record.kv_lora_rank,
                            record.field("scales").offset, group, nope_scale, rope_scale)
    return KernelFields(kind, record.field("nope").offset, record.field("rope").offset,
                        record.field("nope_scale").offset, group, nope_scale, rope_scale)


def _pow2(n: int) -> int:
    return int(triton.next_power_of_2(max(1, n)))


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Whether triton.jit interprets is fixed when the decorator runs, so the kernel module is
# re-imported when TRITON_INTERPRET changed since (tests switch it in a fixture).
_MODE = {"interpret": _interpreting()}


def _kernels() -> ModuleType:
    """The kernel module, jitted for the current TRITON_INTERPRET setting."""
    if _MODE["interpret"] != _interpreting():
        importlib.reload(triton_kernels)
        _MODE["interpret"] = _interpreting()
    return triton_kernels


def _pages(cache: Tensor, record: MLARecord, page_size: int) -> tuple[Tensor, int]:
    """The cache as flat bytes and its page stride in bytes."""
    if cache.dtype != torch.uint8 or not cache.is_contiguous() or cache.dim() not in (2, 3):
        raise ValueError(f"{record.kind} cache must be contiguous uint8 [num_pages, page_bytes] "
                         f"or [num_pages, page_size, bytes_per_token], got "
                         f"{tuple(cache.shape)} {cache.dtype}")
    page_bytes = cache[0].numel()
    if page_bytes < page_size * record.bytes_per_token or page_bytes % 4:
        raise ValueError(f"{record.kind} cache pages hold {page_bytes} bytes, need at least "
                         f"{page_size} x {record.bytes_per_token} and a multiple of 4")
    return cache.view(-1), page_bytes


@functools.cache
def _sm_count(index: int) -> int:
    """Streaming multiprocessors of CUDA device ``index`` (asked once per device)."""
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def split_cost(splits: int, programs: int, slots: int, max_keys: int, block_n: int,
               bytes_per_key: int, partial_bytes: int) -> int:
    """Modelled time of a decode launch with ``splits`` KV splits per (token, head block), in
    bytes one program moves: the waves of ``programs * splits`` programs over ``slots``
    resident ones, times each program's bytes (its records, rounded to whole tiles, plus its
    float32 partial written and read back by the combine when split). Every program of a
    launch does the same work, so a wave that is not full costs as much as a full one."""
    per_split = -(-max_keys // splits)
    keys = -(-per_split // block_n) * block_n
    waves = -(-programs * splits // slots)
    return waves * (keys * bytes_per_key + (2 * partial_bytes if splits > 1 else 0))


# Memoized: asked once per layer and step with the same few arguments.
@functools.lru_cache(maxsize=1024)
def choose_splits(num_tokens: int, head_blocks: int, max_keys: int, num_sms: int,
                  resident: int = DEFAULT_RESIDENT, *, block_n: int = 32,
                  bytes_per_key: int = 1152, partial_bytes: int = 16 * 512 * 4,
                  min_split_keys: int = MIN_SPLIT_KEYS) -> int:
    """KV splits per query token: the count from 1 to ``MAX_SPLITS`` (each split keeping at
    least ``min_split_keys`` keys, ``MIN_SPLIT_KEYS`` unless the kernel says otherwise) with
    the least ``split_cost`` on ``num_sms`` SMs holding ``resident`` programs each; the
    fewest splits among equals (less to combine)."""
    programs = max(1, num_tokens * head_blocks)
    slots = max(1, num_sms * resident)
    most = max(1, min(MAX_SPLITS, max_keys // max(1, min_split_keys)))
    return min(range(1, most + 1),
               key=lambda s: (split_cost(s, programs, slots, max_keys, block_n, bytes_per_key,
                                         partial_bytes), s))


#: Resident programs per SM of each compiled decode configuration, by (constexprs, warps,
#: stages, device).
_RESIDENT: dict[tuple[Any, ...], int] = {}


def resident_programs(compiled: Any, num_warps: int, device: torch.device) -> int:
    """Programs of ``compiled`` (a Triton CompiledKernel) one SM of ``device`` holds, from its
    registers per thread and shared memory (``DEFAULT_RESIDENT`` when they are unknown)."""
    try:
        compiled._init_handles()  # loads the binary: sets n_regs
        regs, shared = int(compiled.n_regs), int(compiled.metadata.shared)
    except (AttributeError, TypeError, RuntimeError):
        return DEFAULT_RESIDENT
    if regs <= 0:
        return DEFAULT_RESIDENT
    return device_programs_per_sm(regs, shared, num_warps, device)


def device_programs_per_sm(regs: int, shared: int, num_warps: int,
                           device: torch.device | int) -> int:
    """``programs_per_sm`` with the register file, shared memory and threads of CUDA
    ``device`` (sm_90's where torch does not report them)."""
    props = torch.cuda.get_device_properties(device)
    return programs_per_sm(regs, shared, num_warps,
                           regs_per_sm=int(getattr(props, "regs_per_multiprocessor", 65536)),
                           smem_per_sm=int(getattr(props, "shared_memory_per_multiprocessor",
                                                   233472)),
                           threads_per_sm=int(getattr(props, "max_threads_per_multi_processor",
                                                      2048)))


def programs_per_sm(regs: int, shared: int, num_warps: int, *, regs_per_sm: int = 65536,
                    smem_per_sm: int = 233472, threads_per_sm: int = 2048) -> int:
    """Blocks of ``num_warps`` warps using ``regs`` registers per thread and ``shared`` bytes
    of shared memory that one SM holds (sm_90 defaults). Registers are allocated per warp
    in units of 256 from each of the four schedulers' quarter of the file; each block's
    shared memory comes with 1 KB reserved."""
    per_warp = -(-regs * 32 // 256) * 256
    by_regs = (regs_per_sm // 4 // per_warp) * 4 // num_warps
    by_smem = smem_per_sm // (shared + 1024)
    return max(1, min(by_regs, by_smem, threads_per_sm // (32 * num_warps), 32))


# The last metadata's token tables: every layer of a step gets the same metadata object.
_LAST: dict[str, object] = {}


def _topk_table(topk_indices: Tensor, num_tokens: int) -> Tensor:
    """The top-k positions ``[T, K]`` as the kernels read them (int32, rows contiguous)."""
    if topk_indices.dim() != 2 or topk_indices.shape[0] != num_tokens:
        raise ValueError(f"topk_indices must be [T={num_tokens}, K], got "
                         f"{tuple(topk_indices.shape)}")
    return topk_indices.int().contiguous()


def _token_tables(metadata: AttentionMetadata, num_tokens: int,
                  sliding_window: int | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per query token: its sequence, its causal key count (position + 1) and first key;
    and the block table as contiguous int32 (cached for the most recent metadata object:
    made once per step, not once per layer). Tables made outside a CUDA graph capture are
    not reused inside one (nor the reverse): a graph must compute its own from its buffers,
    or every replay would read the tables of the step it was captured after."""
    capturing = metadata.seq_lens.is_cuda and torch.cuda.is_current_stream_capturing()
    key = (num_tokens, sliding_window, capturing)
    if _LAST.get("metadata") is metadata and _LAST.get("key") == key:
        return _LAST["tables"]  # type: ignore[return-value]
    tables = (*_compute_tables(metadata, num_tokens, sliding_window),
              metadata.block_tables.int().contiguous())
    _LAST.update(metadata=metadata, key=key, tables=tables)
    return tables


def _compute_tables(metadata: AttentionMetadata, num_tokens: int,
                    sliding_window: int | None) -> tuple[Tensor, Tensor, Tensor]:
    qsl = metadata.query_start_loc.long()
    counts = qsl[1:] - qsl[:-1]
    batch = counts.shape[0]
    device = qsl.device
    seq = torch.repeat_interleave(torch.arange(batch, device=device), counts,
                                  output_size=num_tokens)
    local = torch.arange(num_tokens, device=device) - qsl[seq]
    length = metadata.seq_lens.long()[seq] - counts[seq] + local + 1
    start = (torch.clamp(length - sliding_window, min=0) if sliding_window is not None
             else torch.zeros_like(length))
    return seq.int(), length.int(), start.int()


def default_block_n(record: MLARecord, block_h: int) -> int:
    """Keys per tile when the caller gives none. Wide latents: 64 keys for bf16 records at
    16 heads (their loads are the compiler's asynchronous copies, no registers held: 84
    registers at 8 warps on sm_90), 32 for quantized ones (106-255 registers, no spills),
    16 for 32-head blocks of E8M0-scaled records (32 keys spill there)."""
    if _pow2(record.kv_lora_rank) < 256:
        return 64
    scaled = kernel_fields(record).nope_scale
    if block_h <= 16 and scaled == 0:
        return 64
    return 16 if block_h > 16 and scaled == 2 else 32


def default_warps(record: MLARecord, block_h: int = 16) -> int:
    """Warps per decode program when the caller gives none: 8 for 32-head blocks of wide
    latents and for bf16 records' 64-key tiles, else 4 (H200, 16 heads, batch 64, 8k-32k
    keys, splits from the occupancy of each build: bf16 records 4.0 TB/s with 64-key tiles
    and 8 warps against 3.3 with 32 and 4; quantized records 1.3-1.5x faster with 4 warps
    than with 8)."""
    if _pow2(record.kv_lora_rank) < 256:
        return 4
    if block_h > 16 or kernel_fields(record).nope_scale == 0:
        return 8
    return 4


def default_l2_ahead(record: MLARecord) -> int:
    """Tiles ahead whose records are asked of L2 when the caller gives none: ``L2_AHEAD``
    for quantized records; none for bf16 records (H200: the compiler's pipelining of
    their plain loads already keeps enough in flight, and the prefetches cost 5-20%)."""
    return 0 if kernel_fields(record).nope_scale == 0 else L2_AHEAD


def launch_constants(record: MLARecord, heads: int, page_size: int, page_bytes: int, *,
                     block_n: int | None = None, chunked: bool | None = None,
                     grouped: bool | None = None, reg_prefetch: bool = True,
                     l2_ahead: int | None = None, sparse: bool = False,
                     fast_fp8: bool = True, interpreting: bool = False,
                     f16_dot: bool = False) -> dict[str, Any]:
    """The decode kernel's constexprs (see ``_launch_constants``; memoized: every layer of
    every step asks for the same ones)."""
    if l2_ahead is None:
        l2_ahead = default_l2_ahead(record)
    return dict(_launch_constants(record, heads, page_size, page_bytes, block_n, chunked,
                                  grouped, reg_prefetch, l2_ahead, sparse, fast_fp8,
                                  interpreting, f16_dot))


@functools.lru_cache(maxsize=256)
def _launch_constants(record: MLARecord, heads: int, page_size: int, page_bytes: int,
                      block_n: int | None, chunked: bool | None, grouped: bool | None,
                      reg_prefetch: bool, l2_ahead: int, sparse: bool, fast_fp8: bool,
                      interpreting: bool, f16_dot: bool) -> tuple[tuple[str, Any], ...]:
    """The decode kernel's constexprs for ``record`` at ``heads`` query heads (also used to
    compile launch configurations without a GPU, ``bench/mla_decode/registers.py``).

    ``grouped`` (quantized nope only): the nope part as one chunk per scale group, the
    codes fed to the dots unscaled and each group's scale applied to its partial scores and
    folded into the probabilities of its value product, instead of scaling every element.

    ``f16_dot`` (GPU, quantized records): the dots take float16 operands, the E4M3 codes
    decoded and scaled in float16 (fewer instructions per element than bfloat16); valid
    while the latents, queries and scaled values lie within float16's range.
    """
    f = kernel_fields(record)
    rank, rope = record.kv_lora_rank, record.rope_dim
    block_h = min(max(16, _pow2(heads)), 32)
    d_pad = _pow2(rank)
    block_n = block_n or default_block_n(record, block_h)
    if grouped is None:
        grouped = False
    # Groups that tile the padded width evenly, at least 16 columns (one MMA's K).
    grouped = bool(grouped and f.nope_scale != 0 and d_pad % f.group == 0 and f.group >= 16
                   and f.group & (f.group - 1) == 0)
    if chunked is None:
        # With 32-head blocks and scale groups below a chunk (MXFP8's 32) the flat layout
        # spills on sm_90; per-warp chunks do not.
        chunked = block_h > 16 and d_pad >= 256 and (record.group_size or d_pad) < NOPE_CHUNK
    chunk = f.group if grouped else min(d_pad, NOPE_CHUNK)
    f16 = bool(f16_dot and fast_fp8 and not interpreting and f.nope_scale != 0)
    return tuple(dict(
        RANK=rank, ROPE=rope, NC=d_pad // chunk, CH=chunk, R_PAD=_pow2(max(rope, 16)),
        BLOCK_H=block_h, BLOCK_N=block_n, PAGE_SIZE=page_size, PAGE_BYTES=page_bytes,
        BPT=record.bytes_per_token, NOPE_OFF=f.nope_off, ROPE_OFF=f.rope_off,
        SCALE_OFF=f.scale_off, GROUP=f.group, NOPE_SCALE=f.nope_scale,
        ROPE_SCALE=f.rope_scale, SPARSE=sparse, FAST_FP8=fast_fp8,
        DOT=tl.float32 if interpreting else tl.float16 if f16 else tl.bfloat16,
        F16_DOT=f16,
        CHUNKED=bool(chunked or grouped), GROUPED=grouped,
        REG_PREFETCH=reg_prefetch,
        L2_AHEAD=0 if interpreting or not fast_fp8 else l2_ahead,
        L2_LINES=_pow2(-(-record.bytes_per_token // 128) + 1),
    ).items())


def mla_decode(query: Tensor, cache: Tensor, record: MLARecord, page_size: int,
               metadata: AttentionMetadata, scale: float, *, num_splits: int | None = None,
               topk_indices: Tensor | None = None, sliding_window: int | None = None,
               num_sms: int | None = None, block_n: int | None = None,
               num_warps: int | None = None, num_stages: int = 2,
               chunked: bool | None = None, grouped: bool | None = None,
               reg_prefetch: bool = True, l2_ahead: int | None = None,
               f16_dot: bool = False, kernel: str = "auto",
               cuda_build: dict[str, Any] | None = None) -> tuple[Tensor, Tensor]:
    """Absorbed MLA attention over paged records on the GPU (or the Triton interpreter).

    Same inputs and results as ``mla.mla_attention``: ``(out [T, H, kv_lora_rank] in
    query.dtype, lse [T, H] float32)``. ``num_splits`` None picks ``choose_splits`` from
    the batch, the head blocks, the block table's capacity, ``num_sms`` (the device's) and
    the programs an SM holds of the compiled kernel (``resident_programs``).
    ``block_n`` (keys per tile), ``num_warps``, ``num_stages``, ``chunked`` (the nope
    part as per-warp chunks of ``NOPE_CHUNK`` columns, see the kernel), ``grouped`` (see
    ``launch_constants``) and ``reg_prefetch`` (quantized flat tiles: the next tile's codes
    loaded into registers ahead; off, the compiler's pipelining decides) and ``l2_ahead``
    (tiles ahead whose records are prefetched into L2; 0: none; None:
    ``default_l2_ahead``) and ``f16_dot`` (see ``launch_constants``) override the
    launch configuration (for tuning; defaults depend on the latent width). ``kernel``
    (one of ``KERNELS``): ``"auto"`` runs the CUDA kernel (``cuda_mla``) where it
    applies and the Triton kernel elsewhere, ``"triton"`` always the Triton kernel,
    ``"cuda"`` the CUDA kernel or a ``ValueError`` saying why it cannot (``"auto"`` with a
    Triton launch option given runs the Triton kernel); ``cuda_build``
    (keywords of ``cuda_mla.build_for``: stages, min_blocks, query_in_shared, tile,
    split_sum, bulk_copy; none: ``cuda_mla.preferred_build`` for the page size and record
    kind) tunes the CUDA build. The per-token tables
    are reused while the same ``metadata`` object comes back (every layer of a step), so a
    metadata object must not be changed in place after a call.
    """
    num_tokens, heads, dim = query.shape
    if dim != record.latent_dim:
        raise ValueError(f"{record.kind} MLA query is [T, H, {record.dims_text} = "
                         f"{record.latent_dim}], got {tuple(query.shape)}")
    flat, page_bytes = _pages(cache, record, page_size)
    rank = record.kv_lora_rank
    if kernel not in KERNELS:
        raise ValueError(f"mla_decode kernel={kernel!r}; valid: {list(KERNELS)}")
    # Launch options of the Triton kernel name it: "auto" then runs what was asked for.
    triton_options = (any(v is not None for v in (block_n, num_warps, chunked, grouped, l2_ahead))
                      or f16_dot or not reg_prefetch or num_stages != 2)
    if kernel == "cuda" or (kernel == "auto" and not triton_options and not _interpreting()):
        done = _decode_cuda(query, flat, page_bytes, record, page_size, metadata, scale,
                            num_splits, topk_indices, sliding_window, num_sms,
                            forced=kernel == "cuda",
                            build=cuda_build or {})
        if done is not None:
            return done
    consts = launch_constants(record, heads, page_size, page_bytes, block_n=block_n,
                              chunked=chunked, grouped=grouped, reg_prefetch=reg_prefetch,
                              l2_ahead=l2_ahead, f16_dot=f16_dot,
                              sparse=topk_indices is not None,
                              fast_fp8=query.is_cuda and not _interpreting(),
                              interpreting=_interpreting())
    # waits and releases (kernelbay.triton_pdl), so that the combine after it may be its
    # programmatic dependent in a CUDA graph
    consts["PDL"] = triton_pdl.enabled(query.device)
    head_blocks = -(-heads // consts["BLOCK_H"])
    warps = num_warps or default_warps(record, consts["BLOCK_H"])
    out = torch.empty(num_tokens, heads, rank, dtype=query.dtype, device=query.device)
    lse = torch.empty(num_tokens, heads, dtype=torch.float32, device=query.device)
    if num_tokens == 0:
        return out, lse
    query = query.contiguous()
    seq, length, start, block_tables = _token_tables(metadata, num_tokens, sliding_window)
    if topk_indices is not None:
        topk = _topk_table(topk_indices, num_tokens)
        num_topk = topk.shape[1]
    else:
        topk, num_topk = seq, 0
    decode = _kernels().mla_decode_kernel

    def args(part: Any, plse: Any, splits: int) -> tuple[Any, ...]:
        strides = ((part.stride(0), part.stride(1), part.stride(2), plse.stride(0),
                    plse.stride(1)) if isinstance(part, Tensor) else (0, 0, 0, 0, 0))
        return (query, query.stride(0), query.stride(1),
                flat, block_tables, block_tables.stride(0),
                seq, length, start,
                topk, topk.stride(0) if topk.dim() == 2 else 0, num_topk,
                part, *strides[:3], plse, *strides[3:],
                heads, float(scale), splits)

    resident = None
    if num_splits is None:
        resident = DEFAULT_RESIDENT
        if query.is_cuda and not _interpreting():
            key = (tuple(consts.items()), warps, num_stages, query.device)
            if key not in _RESIDENT:
                # Compiled now (a split launch's variant: float32 partials), so that the
                # split count can count the programs an SM really holds. A triton without
                # this warmup signature keeps the default count (the launch compiles).
                try:
                    compiled = decode.warmup(*args(torch.float32, torch.float32, 2),
                                             grid=(1,), **consts, num_warps=warps,
                                             num_stages=num_stages)
                except (AttributeError, TypeError):
                    _RESIDENT[key] = DEFAULT_RESIDENT
                else:
                    _RESIDENT[key] = resident_programs(compiled, warps, query.device)
            resident = _RESIDENT[key]
        sms = num_sms if num_sms is not None else (
            _sm_count(query.device.index if query.device.index is not None
                      else torch.cuda.current_device()) if query.is_cuda else 1)
        max_keys = (topk_indices.shape[-1] if topk_indices is not None
                    else metadata.block_tables.shape[1] * page_size)
        num_splits = choose_splits(num_tokens, head_blocks, max_keys, sms, resident,
                                   block_n=consts["BLOCK_N"],
                                   bytes_per_key=record.bytes_per_token,
                                   partial_bytes=consts["BLOCK_H"] * rank * 4)
    part, plse = _partials(out, lse, num_splits)
    with triton_pdl.dependent(query.device, consts["PDL"]):
        decode[(num_tokens * num_splits * head_blocks,)](
            *args(part, plse, num_splits), **consts, num_warps=warps, num_stages=num_stages)
    _LAST_SPLITS.update(splits=num_splits, resident=resident, kernel="triton")
    if num_splits > 1:
        _combine(part, plse, out, lse, num_splits)
    return out, lse


def _partials(out: Tensor, lse: Tensor, num_splits: int) -> tuple[Tensor, Tensor]:
    """Where a decode kernel writes: float32 partials [T, S, H, rank] and their LSEs [T, S, H]
    for ``num_splits`` > 1; with one split the output and its LSE themselves (a split axis of
    one)."""
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if num_splits == 1:
        return out.unsqueeze(1), lse.unsqueeze(1)
    num_tokens, heads, rank = out.shape
    return (torch.empty(num_tokens, num_splits, heads, rank, dtype=torch.float32,
                        device=out.device),
            torch.empty(num_tokens, num_splits, heads, dtype=torch.float32, device=out.device))


def combine_blocks(programs: int, num_splits: int, rank: int, sms: int) -> tuple[int, int]:
    """The combine's (splits per load, columns per program) for ``programs`` (tokens x heads)
    merging ``num_splits`` partials of ``rank`` columns on ``sms`` multiprocessors. With a
    program per SM or more, one whole row per load and split (enough loads in flight across
    the programs; smaller blocks only added programs: 2.3-3.8x slower at 1024-2048 programs
    of 2-6 splits). With fewer, ``COMBINE_COLUMNS``-column programs reading up to
    ``COMBINE_SPLITS`` splits per load: a program no longer waits on L2 once per split (64
    and 128 splits at one token, 16 heads: 2.6 and 3.9 us against 7.9 and 14.1;
    ``bench/results/mla-combine-ab-h200.md``)."""
    if programs >= sms:
        return 1, _pow2(rank)
    return min(_pow2(num_splits), COMBINE_SPLITS), COMBINE_COLUMNS


def _combine(part: Tensor, plse: Tensor, out: Tensor, lse: Tensor, num_splits: int,
             num_sms: int | None = None) -> None:
    """Merge the split partials ``part [T, S, H, rank]``/``plse [T, S, H]`` into
    ``out``/``lse`` (the combine kernel, blocks from ``combine_blocks`` for ``num_sms`` or the
    device's multiprocessors)."""
    num_tokens, heads, rank = out.shape
    if num_sms is None:
        num_sms = _sm_count(out.device.index if out.device.index is not None
                            else torch.cuda.current_device()) if out.is_cuda else 1
    s_block, block_d = combine_blocks(num_tokens * heads, num_splits, rank, num_sms)
    # a programmatic dependent of the decode kernel before it where that one releases (in a
    # CUDA graph): its launch overlaps that kernel's last CTAs
    pdl = triton_pdl.enabled(out.device)
    with triton_pdl.dependent(out.device, pdl):
        _kernels().mla_combine_kernel[(num_tokens, heads, -(-rank // block_d))](
            part, part.stride(0), part.stride(1), part.stride(2),
            plse, plse.stride(0), plse.stride(1),
            out, out.stride(0), out.stride(1),
            lse, lse.stride(0),
            heads, num_splits,
            S_PAD=_pow2(num_splits), S_BLOCK=s_block, RANK=rank, BLOCK_D=block_d, PDL=pdl,
            num_warps=4,
        )


#: Columns of one combine program when there are fewer (token, head) pairs than SMs.
COMBINE_COLUMNS = 128
#: Most splits the combine reads per load then (32 floats per thread at 128 columns and four
#: warps).
COMBINE_SPLITS = 32


#: ``mla_decode``'s kernel choices.
KERNELS = ("auto", "triton", "cuda")
#: Resident CTAs per SM of each CUDA build, by (build, device).
_CUDA_RESIDENT: dict[tuple[Any, int], int] = {}


def _decode_cuda(query: Tensor, flat: Tensor, page_bytes: int, record: MLARecord,
                 page_size: int, metadata: AttentionMetadata, scale: float,
                 num_splits: int | None, topk_indices: Tensor | None,
                 sliding_window: int | None,
                 num_sms: int | None, *, forced: bool,
                 build: dict[str, Any]) -> tuple[Tensor, Tensor] | None:
    """``mla_decode`` through the CUDA kernel (E4M3 records), or None where it does not apply
    (or the build does not compile or load on this device: it warns once per build and the
    Triton kernel serves the call); ``forced`` raises instead of returning None."""
    from kernelbay.cuda_jit import CudaJitError

    from kernelbay_attn_flashmla import cuda_mla

    sparse = topk_indices is not None
    options = cuda_mla.call_build(page_size, build, record.kind)
    reason = cuda_mla.unsupported(query, record, page_size, page_bytes, sparse, float(scale),
                                  options.get("tile", cuda_mla.DecodeBuild.tile), flat)
    device = query.device.index or 0  # CUDA tensors always carry their index
    compiled = None
    if reason is None:  # the record is one the kernel reads: its build can be made
        compiled = cuda_mla.build_for(record, sparse, **options)
        broken = cuda_mla.broken_reason(device, compiled)
        if broken is not None:
            reason = f"its build failed on this device: {broken}"
    if reason is not None or compiled is None:
        if forced:
            raise ValueError(f"the CUDA MLA decode kernel cannot run this call: {reason}")
        return None
    try:  # compiled and loaded once per build and device (memoized)
        cuda_mla.decode_kernel(compiled, device)
    except CudaJitError as exc:
        if forced:
            raise
        cuda_mla.mark_broken(device, compiled, str(exc))
        return None
    num_tokens, heads, _ = query.shape
    rank = record.kv_lora_rank
    out = torch.empty(num_tokens, heads, rank, dtype=query.dtype, device=query.device)
    lse = torch.empty(num_tokens, heads, dtype=torch.float32, device=query.device)
    if num_tokens == 0:
        return out, lse
    seq, length, start, block_tables = _token_tables(metadata, num_tokens, sliding_window)
    topk = _topk_table(topk_indices, num_tokens) if topk_indices is not None else None
    resident = None
    if num_splits is None:
        key = (compiled, device)
        if key not in _CUDA_RESIDENT:
            _CUDA_RESIDENT[key] = cuda_mla.resident_programs(compiled, device)
        resident = _CUDA_RESIDENT[key]
        num_splits = cuda_mla.choose_cuda_splits(
            num_tokens * -(-heads // cuda_mla.HEADS),
            topk.shape[1] if topk is not None else metadata.block_tables.shape[1] * page_size,
            num_sms if num_sms is not None else _sm_count(device), resident, compiled.tile,
            record.bytes_per_token, cuda_mla.HEADS * rank * 4)
    part, plse = _partials(out, lse, num_splits)
    # a launch error, unlike a build that fails, is a real failure: it propagates
    cuda_mla.launch_decode(compiled, query, flat, page_bytes, page_size, block_tables, seq,
                           length, start, part, plse, out, float(scale), num_splits, topk)
    _LAST_SPLITS.update(splits=num_splits, resident=resident, kernel="cuda")
    if num_splits > 1:
        _combine(part, plse, out, lse, num_splits)
    return out, lse


#: The most recent ``mla_decode`` launch's split count and the resident programs per SM it
#: was chosen for (None when the caller gave the count), and its kernel ("triton" or
#: "cuda"); ``last_splits`` and ``last_kernel`` report them.
_LAST_SPLITS: dict[str, Any] = {}


def last_kernel() -> str | None:
    """Which kernel served the most recent ``mla_decode`` call (``"triton"``, ``"cuda"``;
    None before the first call)."""
    return _LAST_SPLITS.get("kernel")


def last_splits() -> tuple[int | None, int | None]:
    """``(splits, resident programs per SM)`` of the most recent ``mla_decode`` call, for
    benchmarks and reports: the KV splits per query token and the occupancy the split model
    counted (None when the call gave ``num_splits``; both None before the first call)."""
    return _LAST_SPLITS.get("splits"), _LAST_SPLITS.get("resident")


def mla_write(cache: Tensor, record: MLARecord, page_size: int, latent: Tensor,
              slot_mapping: Tensor) -> None:
    """Encode ``latent [T, kv_lora_rank + rope_dim]`` into the records of ``slot_mapping``
    (bit for bit as ``codec.encode_records``); negative slots are skipped."""
    if latent.dim() != 2 or latent.shape[-1] != record.latent_dim:
        raise ValueError(f"{record.kind} records hold {record.dims_text} latent dims, got a "
                         f"latent of shape {tuple(latent.shape)}")
    if slot_mapping.shape[0] != latent.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} slots for "
                         f"{latent.shape[0]} latents")
    if latent.shape[0] == 0:
        return
    flat, page_bytes = _pages(cache, record, page_size)
    latent = latent if latent.stride(-1) == 1 else latent.contiguous()
    f = kernel_fields(record)
    scaled = record.latent_dim if record.kind == "mxfp8" else record.kv_lora_rank
    _kernels().mla_write_kernel[(latent.shape[0],)](
        latent, latent.stride(0), slot_mapping.contiguous(),
        flat, flat.view(torch.int16), flat.view(torch.float32),
        RANK=record.kv_lora_rank, ROPE=record.rope_dim, D_PAD=_pow2(record.kv_lora_rank),
        R_PAD=_pow2(record.rope_dim), PAGE_SIZE=page_size, PAGE_BYTES=page_bytes,
        BPT=record.bytes_per_token, KIND=f.kind, NOPE_OFF=f.nope_off, ROPE_OFF=f.rope_off,
        SCALE_OFF=f.scale_off, GROUP=f.group, G_PAD=_pow2(scaled // f.group),
        DIV_RN=latent.is_cuda and not _interpreting(),
        num_warps=4,
    )
