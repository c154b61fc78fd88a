"""Host side of the CUDA MLA decode kernel for E4M3 records (``cuda/mla_decode_mx.cu``).

The kernel is built at run time by NVRTC through ``kernelbay.cuda_jit`` (no toolkit, no
compiled extension) and serves ``triton_mla.mla_decode`` where ``unsupported`` finds nothing
against it: records of one of ``KINDS`` (MXFP8 with 512 values, latent + rope as
DeepSeek-V4's 448 + 64; fp8-e8m0 and fp8 with an E4M3 latent of at most 512 and a bfloat16
rope of 64), bfloat16 queries, dense attention or top-k lists, a CUDA device of compute
capability 8.0 or newer (9.0 for top-k lists and for records whose size is not a multiple of
16 bytes, which only bulk copies take). Everything else
(and every case after a failed build, which warns once) stays with the Triton kernel. The
split count and the combine are ``triton_mla``'s; this module launches the partials.
"""

from __future__ import annotations

import functools
import importlib.resources
import warnings
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from kernelbay_attn_flashmla.records import MLARecord

if TYPE_CHECKING:
    import torch
    from kernelbay.cuda_jit import Kernel

__all__ = ["DIM", "HEADS", "KINDS", "MIN_SPLIT_TILES", "PREFERRED_32", "ROPE", "TILE", "WARPS",
           "DecodeBuild", "broken_reason", "build_for", "build_options", "call_build",
           "choose_cuda_splits", "decode_kernel", "key_slot_bytes", "launch_decode",
           "mark_broken", "preferred_build", "resident_programs", "shared_bytes",
           "static_reason", "unsupported"]

#: Keys per tile of the default build (a tile lies in one page, so the page size must be a
#: multiple); builds take 16 or 32.
TILE = 16
#: Warps per CTA; warp w owns the record values [128 w, 128 w + 128).
WARPS = 4
#: Values per record the kernel is written for (four warps of 128).
DIM = 512
#: Query heads per CTA (the rows of one MMA).
HEADS = 16
#: The record kinds the kernel reads, with their ``KIND`` code in the source and the scale
#: group it is written for: MXFP8 (E4M3 latent and rope, an E8M0 byte per 32), fp8-e8m0 (E4M3
#: latent, an E8M0 byte per 64, bfloat16 rope) and fp8 (E4M3 latent, a float32 multiplier per
#: 128, bfloat16 rope).
KINDS: dict[str, tuple[int, int]] = {"mxfp8": (0, 32), "fp8-e8m0": (1, 64), "fp8": (2, 128)}
#: bfloat16 rope values of the fp8 and fp8-e8m0 records the kernel reads (16 per warp).
ROPE = 64
#: Fewest tiles a KV split of this kernel gets where the grid stays within one CTA per SM
#: (``choose_cuda_splits``).
MIN_SPLIT_TILES = 4


@dataclass(frozen=True)
class DecodeBuild:
    """One compiled variant: the record's geometry (latent width, record size, scales'
    offset, kind, bfloat16 rope's offset), whether keys come from top-k lists (``sparse``)
    and the launch shape (``build_for`` documents each option; the defaults are the
    fastest 16-key build on the H200, ``preferred_build`` the build calls get by default)."""

    rank: int
    bytes_per_token: int
    scale_offset: int
    kind: str = "mxfp8"
    rope_offset: int = 0
    sparse: bool = False
    stages: int = 3
    min_blocks: int = 3
    query_in_shared: bool = False
    tile: int = TILE
    split_sum: bool = True
    bulk_copy: bool = True
    lazy_max: bool = True


#: ``DecodeBuild``'s fields that come from the record and the call (the rest are launch
#: options).
_GEOMETRY = ("rank", "bytes_per_token", "scale_offset", "kind", "rope_offset", "sparse")


def build_for(record: MLARecord, sparse: bool = False, **options: Any) -> DecodeBuild:
    """The build for ``record`` (offsets read from its descriptor) with ``DecodeBuild``'s
    launch options where ``options`` names none of them: ``stages`` tiles in
    flight (at least 2), registers capped for ``min_blocks`` CTAs per SM (1 to 4), and the
    query slice in shared memory instead of registers (``query_in_shared``), ``tile`` keys
    per barrier round (16 or 32), the warps' partial scores summed in two phases
    (``split_sum``: half the shared-memory reads, one more barrier per tile), and each tile
    copied by one bulk (TMA) copy completing on an mbarrier (``bulk_copy``, sm_90, needs
    ``split_sum``, which it follows when not given; older GPUs take the other path) instead
    of 16-byte copies by every thread (whose requests load the SM's L1 pipeline, the
    kernel's bottleneck), and each warp exponentiating the score totals it sums against the
    running max (``lazy_max``, needs ``split_sum`` and follows it when not given: the softmax
    once per CTA instead of once per warp, except on a tile that raises the max by more than
    2^8; 7-8% faster on the H200, ``bench/results/mla_decode-h200.md``)."""
    options = dict(options)
    for follower in ("bulk_copy", "lazy_max"):
        if options.get(follower) is None:
            options[follower] = options.get("split_sum", DecodeBuild.split_sum)
    launch = [f.name for f in fields(DecodeBuild)][len(_GEOMETRY):]
    if set(options) - set(launch):
        raise ValueError(f"CUDA MLA decode build: options {sorted(set(options) - set(launch))}; "
                         f"valid: {launch}")
    bf16_rope = record.kind != "mxfp8"
    build = DecodeBuild(record.kv_lora_rank, record.bytes_per_token,
                        record.field("nope_scale" if bf16_rope else "scales").offset,
                        record.kind, record.field("rope").offset if bf16_rope else 0, sparse,
                        **options)
    if sparse and not build.bulk_copy:
        raise ValueError(f"CUDA MLA decode build: sparse attention copies each key by one "
                         f"bulk copy: needs bulk_copy=True, got bulk_copy={build.bulk_copy}")
    if build.bytes_per_token % 16 and not build.bulk_copy:
        raise ValueError(f"CUDA MLA decode build: {record.kind} records of "
                         f"{build.bytes_per_token} B need bulk_copy=True (per-thread copies "
                         f"move 16-byte pieces of each record)")
    if build.stages < 2 or not 1 <= build.min_blocks <= 4 or build.tile not in (16, 32) or (
            (build.bulk_copy or build.lazy_max) and not build.split_sum):
        raise ValueError(f"CUDA MLA decode build: stages={build.stages}, "
                         f"min_blocks={build.min_blocks}, tile={build.tile}, "
                         f"bulk_copy={build.bulk_copy}, lazy_max={build.lazy_max}, "
                         f"split_sum={build.split_sum}; valid: stages >= 2, min_blocks in 1..4, "
                         f"tile 16 or 32, bulk_copy and lazy_max only with split_sum")
    return build


#: The 32-key build each record kind's calls get where a page holds whole 32-key tiles (from
#: the H200 sweep, ``bench/mla_decode/run.py --sweep cuda``): two stages with the query slices
#: in shared memory and three CTAs per SM, except fp8, whose float32 multipliers and rope
#: need more registers: three stages, two CTAs per SM, no spills (the three-CTA build spills
#: 96 bytes per thread and took 42% longer at batch 64, 32k keys).
PREFERRED_32: dict[str, dict[str, Any]] = {
    "mxfp8": {"tile": 32, "stages": 2, "query_in_shared": True},
    "fp8-e8m0": {"tile": 32, "stages": 2, "query_in_shared": True},
    "fp8": {"tile": 32, "stages": 3, "min_blocks": 2},
}


def preferred_build(page_size: int, kind: str = "mxfp8") -> dict[str, Any]:
    """The ``build_for`` options of calls that name none: the kind's 32-key build
    (``PREFERRED_32``; MXFP8's for a kind the kernel does not read, which ``unsupported``
    then refuses) where a page holds whole 32-key tiles, else ``build_for``'s 16-key
    defaults. 32-key tiles halve the per-key barriers and softmax steps and give the score
    product four independent MMA chains."""
    if page_size % 32:
        return {}
    return dict(PREFERRED_32.get(kind, PREFERRED_32["mxfp8"]))


def call_build(page_size: int, options: dict[str, Any] | None,
               kind: str = "mxfp8") -> dict[str, Any]:
    """The ``build_for`` options of one call: the caller's ``options`` as given (over
    ``build_for``'s defaults, the 16-key build) when it names any, else
    ``preferred_build(page_size, kind)``; a preference is never mixed into a partial
    choice."""
    return dict(options) if options else preferred_build(page_size, kind)


def choose_cuda_splits(programs: int, max_keys: int, num_sms: int, resident: int, tile: int,
                       bytes_per_key: int, partial_bytes: int) -> int:
    """KV splits per (token, head block) for this kernel: ``triton_mla.choose_splits`` with
    splits of ``MIN_SPLIT_TILES`` tiles where the ``programs`` (tokens x head blocks) times
    that count still fit one CTA per SM, else with the Triton kernel's 256-key minimum.
    Below one CTA per SM, finer splits put idle SMs to work; above it, the extra CTAs share
    SMs and the combine costs more than they save. Measured on the H200 (same-run A/B,
    ``README``): 1k keys at batch 1 and 16 ran 23-28% faster in 8 splits than in 4, 8k keys
    at batch 1 8% faster in 64 than in 32; batch 64 at 1k keys (6 splits, 384 CTAs) and 128
    heads at batch 1, 8k keys (43 splits, 344 CTAs) ran 2-4% slower than with the coarser
    minimum, which they keep."""
    from kernelbay_attn_flashmla.triton_mla import MIN_SPLIT_KEYS, choose_splits

    def choose(min_keys: int) -> int:
        return choose_splits(programs, 1, max_keys, num_sms, resident, block_n=tile,
                             bytes_per_key=bytes_per_key, partial_bytes=partial_bytes,
                             min_split_keys=min_keys)

    fine = choose(MIN_SPLIT_TILES * tile)
    return fine if programs * fine <= num_sms else choose(MIN_SPLIT_KEYS)


def build_options(build: DecodeBuild) -> list[str]:
    """NVRTC defines for ``build``."""
    return [f"-DKIND={KINDS[build.kind][0]}", f"-DDIM={DIM}", f"-DRANK={build.rank}",
            f"-DBPT={build.bytes_per_token}", f"-DSCALE_OFF={build.scale_offset}",
            f"-DROPE_OFF={build.rope_offset}", f"-DSPARSE={int(build.sparse)}",
            f"-DSTAGES={build.stages}",
            f"-DMIN_BLOCKS={build.min_blocks}", f"-DQSMEM={int(build.query_in_shared)}",
            f"-DTILE={build.tile}", f"-DSPLIT_SUM={int(build.split_sum)}",
            f"-DBULK={int(build.bulk_copy)}", f"-DLAZY_MAX={int(build.lazy_max)}"]


def shared_bytes(build: DecodeBuild) -> int:
    """Dynamic shared memory of one CTA: ``stages`` tiles of records, the warps' partial
    scores (four floats per lane and 8-key group), with ``split_sum`` their totals, with
    ``lazy_max`` the shared probabilities (two bf16 per lane and 8-key group and head half),
    with ``query_in_shared`` the warps' query slices, and with ``bulk_copy`` one mbarrier per
    stage (and with ``sparse`` each stage's 4-byte key mask, and where records are not a
    multiple of 16 bytes its mask of keys shifted in their slots; ``key_slot_bytes``)."""
    query = WARPS * 8 * 32 * 16 if build.query_in_shared else 0  # 8 MMA steps x 32 lanes x 16 B
    scores = WARPS * 32 * build.tile // 2 * 4  # [warps][8-key groups][lanes][4] float32
    totals = scores // WARPS if build.split_sum else 0
    probabilities = totals // 2 if build.lazy_max else 0
    barriers = 8 * build.stages if build.bulk_copy else 0  # one mbarrier per stage
    slot = key_slot_bytes(build)
    if build.sparse:  # and each stage's key masks
        barriers += 4 * build.stages * (1 if slot == build.bytes_per_token else 2)
    return build.stages * build.tile * slot + scores + totals + probabilities + query + barriers


def key_slot_bytes(build: DecodeBuild) -> int:
    """Shared memory per key of a tile: the record, or with ``sparse`` (one bulk copy per key,
    of whole 16-byte units from the aligned address at or below the record) the record
    rounded up to 16 bytes."""
    if build.sparse:
        return -(-build.bytes_per_token // 16) * 16
    return build.bytes_per_token


@functools.cache
def _source() -> str:
    return (importlib.resources.files("kernelbay_attn_flashmla") / "cuda"
            / "mla_decode_mx.cu").read_text(encoding="utf-8")


@functools.cache
def decode_kernel(build: DecodeBuild, device: int) -> Kernel:
    """The compiled and loaded kernel of ``build`` on CUDA ``device`` (memoized)."""
    import torch
    from kernelbay.cuda_jit import compile_cubin, load_kernel

    major, minor = torch.cuda.get_device_capability(device)
    cubin = compile_cubin(_source(), "mla_decode_mx", f"sm_{major}{minor}",
                          build_options(build))
    kernel = load_kernel(cubin, "mla_decode_mx", device)
    kernel.set_max_dynamic_shared(shared_bytes(build))
    return kernel


def resident_programs(build: DecodeBuild, device: int) -> int:
    """CTAs of ``build`` one SM of ``device`` holds (its registers and shared memory)."""
    from kernelbay_attn_flashmla.triton_mla import device_programs_per_sm

    kernel = decode_kernel(build, device)
    return device_programs_per_sm(kernel.attribute("registers"),
                                  kernel.attribute("shared_bytes") + shared_bytes(build),
                                  WARPS, device)


#: Builds that failed to compile or load, by (device, build), with the error.
_BROKEN: dict[tuple[int, DecodeBuild], str] = {}


def mark_broken(device: int, build: DecodeBuild, reason: str) -> None:
    """Stop using ``build`` on CUDA ``device`` for the rest of the process (it did not
    compile or load there: an architecture NVRTC does not know, more shared memory than the
    device has, a driver older than the cubin), warning once."""
    if (device, build) not in _BROKEN:
        warnings.warn(f"kernelbay-attn-flashmla: the CUDA MLA decode kernel is off on "
                      f"cuda:{device} for {build} ({reason}); the Triton kernel serves it",
                      RuntimeWarning, stacklevel=3)
    _BROKEN[(device, build)] = reason


def broken_reason(device: int, build: DecodeBuild) -> str | None:
    """Why ``build`` is off on ``device`` (``mark_broken``), or ``None``."""
    return _BROKEN.get((device, build))


def _record_reason(record: MLARecord) -> str | None:
    """Why the kernel cannot read ``record`` (``None`` when it can): its kind, dims, scale
    group and field placement."""
    if record.kind not in KINDS:
        return f"record kind {record.kind!r}; the CUDA kernel reads {sorted(KINDS)}"
    group = KINDS[record.kind][1]
    if record.kind == "mxfp8":
        if record.latent_dim != DIM or record.kv_lora_rank % 32 or record.group_size != group:
            return (f"records of {record.dims_text} values in groups of {record.group_size}; "
                    f"the CUDA kernel reads {DIM} values (latent a multiple of 32) in groups "
                    f"of {group}")
        if record.field("values").offset != 0 or record.field("scales").offset % 4:
            return ("an MXFP8 record whose values do not start at byte 0 or whose scales are "
                    "not 4-byte aligned")
        return None
    rank = record.kv_lora_rank
    if rank > DIM or rank % group or record.group_size != group or record.rope_dim != ROPE:
        return (f"{record.kind} records of {record.dims_text} values in groups of "
                f"{record.group_size}; the CUDA kernel reads a latent of at most {DIM} values "
                f"in groups of {group} and a rope of {ROPE}")
    scales, rope = record.field("nope_scale"), record.field("rope")
    # KIND_E8M0 reads each warp's two scale bytes from an aligned 4-byte word
    words_end = scales.offset + 4 * ((rank - 1) // 256 + 1) if record.kind == "fp8-e8m0" else 0
    if (record.field("nope").offset != 0 or scales.offset % 4 or rope.offset % 8
            or record.bytes_per_token % 8 or words_end > record.bytes_per_token):
        return (f"a {record.kind} record whose latent does not start at byte 0, whose scales "
                f"are not 4-byte or rope not 8-byte aligned, whose size "
                f"({record.bytes_per_token} B) is not a multiple of 8 or whose scale words end "
                f"past it")
    return None


def static_reason(record: MLARecord, dtype: str, sparse: bool, page_size: int,
                  tile: int = TILE) -> str | None:
    """Why layers of this shape cannot run the CUDA kernel anywhere (``None`` when they can):
    the record, the query dtype (``"bfloat16"``), sparse attention, the page size. Shared by
    ``unsupported`` (per call) and the ``explain`` note (per layer)."""
    reason = _record_reason(record)
    if reason is not None:
        return reason
    if dtype != "bfloat16":
        return f"{dtype} queries (the CUDA kernel takes bfloat16)"
    if page_size < tile or page_size & (page_size - 1):
        return f"page_size {page_size} (needs a power of two >= {tile} keys)"
    return None


def unsupported(query: torch.Tensor, record: MLARecord, page_size: int, page_bytes: int,
                sparse: bool, scale: float = 1.0, tile: int = TILE,
                cache: torch.Tensor | None = None) -> str | None:
    """Why this call cannot run the CUDA kernel (``None`` when it can): ``static_reason``,
    then the cache (its 16-byte copies need an aligned base), the device, the page stride,
    the scale, the query's alignment and NVRTC."""
    reason = static_reason(record, str(query.dtype).removeprefix("torch."), sparse, page_size,
                           tile)
    if reason is not None:
        return reason
    if cache is not None and cache.data_ptr() % 16:
        return f"cache base address {cache.data_ptr():#x} not 16-byte aligned"
    import torch
    from kernelbay.cuda_jit import nvrtc_available

    if not query.is_cuda or torch.version.hip is not None:
        return f"query on {query.device} (needs a CUDA device)"
    capability = torch.cuda.get_device_capability(query.device)
    if capability < (8, 0):
        return "compute capability below 8.0"
    if sparse and capability < (9, 0):
        return (f"sparse top-k attention needs the bulk copies of compute capability 9.0, "
                f"not {capability[0]}.{capability[1]}")
    if record.bytes_per_token % 16 and capability < (9, 0):
        return (f"{record.kind} records of {record.bytes_per_token} B (not a multiple of 16) "
                f"need the bulk copies of compute capability 9.0, not "
                f"{capability[0]}.{capability[1]}")
    if page_bytes % 16:
        return f"page stride {page_bytes} B (needs a multiple of 16 bytes)"
    if not scale > 0:
        return f"softmax scale {scale} (the CUDA kernel takes a positive scale)"
    if query.stride(-1) != 1 or query.stride(1) % 8 or query.stride(0) % 8 \
            or query.data_ptr() % 16:
        return "query rows not 16-byte aligned"
    if not nvrtc_available():
        return "NVRTC not installed"
    return None


def launch_decode(build: DecodeBuild, query: torch.Tensor, flat: torch.Tensor, page_bytes: int,
                  page_size: int, block_tables: torch.Tensor, seq: torch.Tensor,
                  length: torch.Tensor, start: torch.Tensor, part: torch.Tensor,
                  plse: torch.Tensor, out: torch.Tensor, scale: float, num_splits: int,
                  topk: torch.Tensor | None = None) -> None:
    """One launch: the partials of every (head block, split, token) into ``part``/``plse``
    when ``num_splits > 1``, else the output into ``out`` and its LSE into ``plse``
    (operands checked by ``unsupported`` and made by ``triton_mla.mla_decode``); ``topk``
    (int32 ``[T, K]``, rows contiguous) the positions each token attends when
    ``build.sparse``."""
    import ctypes

    import torch
    from kernelbay.cuda_jit import programmatic_launch

    if build.sparse != (topk is not None):
        raise ValueError(f"CUDA MLA decode: a {'sparse' if build.sparse else 'dense'} build "
                         f"{'needs' if build.sparse else 'takes no'} top-k indices")
    num_tokens, heads, _ = query.shape
    kernel = decode_kernel(build, query.device.index if query.device.index is not None
                           else torch.cuda.current_device())
    ptr = ctypes.c_void_p
    i64 = ctypes.c_longlong
    i32 = ctypes.c_int
    # one split: part and plse are the output and its LSE with a split axis of one (unused)
    split = num_splits > 1
    ps = (part.stride(0), part.stride(1), part.stride(2)) if split else (0, 0, 0)
    ls = (plse.stride(0), plse.stride(1) if split else 0)
    args = [ptr(query.data_ptr()), i64(query.stride(0)), i64(query.stride(1)),
            ptr(flat.data_ptr()), i64(page_bytes), i32(page_size.bit_length() - 1),
            ptr(block_tables.data_ptr()), i64(block_tables.stride(0)),
            ptr(seq.data_ptr()), ptr(length.data_ptr()), ptr(start.data_ptr()),
            ptr(topk.data_ptr() if topk is not None else 0),
            i64(topk.stride(0) if topk is not None else 0),
            i32(topk.shape[1] if topk is not None else 0),
            ptr(part.data_ptr()), i64(ps[0]), i64(ps[1]), i64(ps[2]),
            ptr(plse.data_ptr()), i64(ls[0]), i64(ls[1]),
            ptr(out.data_ptr()), i64(out.stride(0)), i64(out.stride(1)),
            i32(heads), ctypes.c_float(scale), i32(num_splits)]
    grid = (-(-heads // HEADS) * num_splits * num_tokens, 1, 1)
    # waits before its first global read and releases after its keys (kernelbay.cuda_jit):
    # in a CUDA graph the combine after it becomes its programmatic dependent
    kernel.launch(grid, (WARPS * 32, 1, 1), args,
                  torch.cuda.current_stream(query.device).cuda_stream, shared_bytes(build),
                  programmatic=programmatic_launch())
