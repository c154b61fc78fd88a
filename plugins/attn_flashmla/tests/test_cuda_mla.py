"""The CUDA MLA decode kernel (``cuda_mla``) for E4M3 records against the torch reference.

CPU: NVRTC compiles the source of every record kind for sm_80 and sm_90 (on sm_90 the 16-key
build with no local memory), calls get the build they name or the page size's preferred one,
and the cases the kernel does not take are refused with their reason. GPU, every record kind
(mxfp8, fp8-e8m0, fp8): decoding through single-key attention and through whole tiles of one
record is exact for every E4M3 code under every kind of scale; decode, prefill, sliding
windows, split counts, head counts and never-written (NaN) slots match the reference.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import pytest
import torch
from kernelbay.cuda_jit import compile_cubin, nvrtc_available
from kernelbay.layers import AttentionMetadata
from kernelbay_attn_flashmla import cuda_mla
from kernelbay_attn_flashmla.mla import mla_attention
from kernelbay_attn_flashmla.records import RECORDS, record_for_dims

pytest.importorskip("triton")
from test_triton import Case, _case

MXFP8 = RECORDS["mxfp8"]
#: The record kinds the kernel reads, at their FORMATS.md dims.
KINDS = sorted(cuda_mla.KINDS)


def _builds(record: Any, **options: Any) -> bool:
    """Whether ``record`` takes a build with ``options`` (per-thread copies need records of a
    multiple of 16 bytes)."""
    return record.bytes_per_token % 16 == 0 or cuda_mla.build_for(
        MXFP8, **options).bulk_copy


@pytest.mark.skipif(not nvrtc_available(), reason="needs NVRTC (nvidia-cuda-nvrtc)")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_source_compiles_without_local_memory(arch: str, tmp_path: Any,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from kernelbay.testing.cubins import cubin_resources

    monkeypatch.setenv("KERNELBAY_CACHE_DIR", str(tmp_path))
    records = [MXFP8, record_for_dims("mxfp8", 480, 32), RECORDS["fp8"],
               record_for_dims("fp8", 256, 64), RECORDS["fp8-e8m0"],
               record_for_dims("fp8-e8m0", 320, 64)]
    for record in records:
        if record.bytes_per_token % 16 and arch == "sm_80":
            continue  # whole-tile bulk copies only (cuda_mla.unsupported refuses them there)
        options: list[dict[str, Any]] = [{}, {"stages": 4, "min_blocks": 2},
                                         {"split_sum": False}, {"lazy_max": False},
                                         cuda_mla.preferred_build(64, record.kind)]
        builds = [cuda_mla.build_for(record, **o) for o in options if _builds(record, **o)]
        if arch == "sm_90":  # top-k lists: bulk copies
            builds += [cuda_mla.build_for(record, True),
                       cuda_mla.build_for(record, True, **cuda_mla.PREFERRED_32[record.kind])]
        for build in builds:
            cubin = compile_cubin(cuda_mla._source(), "mla_decode_mx", arch,
                                  cuda_mla.build_options(build))
            assert cubin[:4] == b"\x7fELF"
            # on sm_90, the architecture they are tuned for, the 16-key build keeps everything
            # in registers (fp8 spills two), and the preferred 32-key ones spill at most six
            # loop-invariant registers of MXFP8 (none of fp8, 12 of fp8-e8m0); other builds
            # and sm_80 may spill more
            if arch != "sm_90" or record.kv_lora_rank not in (448, 512):
                continue
            usage = cubin_resources(cubin)
            stack = re.search(r"STACK:(\d+) ", usage)
            assert stack and "LOCAL:0 " in usage, usage
            if build == cuda_mla.build_for(record):
                assert int(stack.group(1)) <= (8 if record.kind == "fp8" else 0), usage
            elif build == cuda_mla.build_for(record, **cuda_mla.PREFERRED_32[record.kind]):
                limit = {"mxfp8": 24, "fp8": 0, "fp8-e8m0": 48}[record.kind]
                assert int(stack.group(1)) <= limit, usage


def test_calls_get_the_build_they_name_or_the_preferred_one() -> None:
    assert cuda_mla.call_build(64, None) == cuda_mla.preferred_build(64)
    assert cuda_mla.preferred_build(64)["tile"] == 32 and cuda_mla.call_build(16, {}) == {}
    assert cuda_mla.call_build(64, None, "fp8") == {"tile": 32, "stages": 3, "min_blocks": 2}
    assert cuda_mla.call_build(16, None, "fp8") == {}
    # a partial choice is taken over build_for's (16-key) defaults, never mixed with the
    # preference; bulk copies and the lazy max follow the two-phase sum unless named
    assert cuda_mla.call_build(64, {"stages": 4}) == {"stages": 4}
    assert cuda_mla.build_for(MXFP8).lazy_max and cuda_mla.build_for(MXFP8).bulk_copy
    build = cuda_mla.build_for(MXFP8, **cuda_mla.call_build(64, {"split_sum": False}))
    assert build.tile == 16 and not build.bulk_copy and not build.lazy_max
    with pytest.raises(ValueError, match="bulk_copy and lazy_max only with split_sum"):
        cuda_mla.build_for(MXFP8, split_sum=False, bulk_copy=True)
    with pytest.raises(ValueError, match=r"lazy_max=True, split_sum=False"):
        cuda_mla.build_for(MXFP8, split_sum=False, bulk_copy=False, lazy_max=True)
    with pytest.raises(ValueError, match=r"options \['stage'\]; valid: \['stages'"):
        cuda_mla.build_for(MXFP8, stage=2)


def test_refusals_name_the_reason() -> None:
    from kernelbay_attn_flashmla.records import fp8_e8m0_record

    query = torch.zeros(1, 16, 512, dtype=torch.bfloat16)
    bf16 = RECORDS["bf16"]
    assert "record kind 'bf16'; the CUDA kernel reads ['fp8', 'fp8-e8m0', 'mxfp8']" in (
        cuda_mla.unsupported(query, bf16, 64, bf16.page_bytes(64), False) or "")
    assert "512 values" in (cuda_mla.unsupported(torch.zeros(1, 16, 80), record_for_dims(
        "mxfp8", 64, 16), 64, 8192, False) or "")
    groups32 = fp8_e8m0_record(448, 64, 32)
    assert "in groups of 32; the CUDA kernel reads a latent of at most 512 values in groups " \
        "of 64 and a rope of 64" in (cuda_mla.unsupported(query, groups32, 64,
                                                          groups32.page_bytes(64), False) or "")
    short_rope = record_for_dims("fp8", 512, 32)
    assert "a rope of 64" in (cuda_mla.unsupported(torch.zeros(1, 16, 544), short_rope, 64,
                                                   short_rope.page_bytes(64), False) or "")
    three_groups = record_for_dims("fp8", 384, 64)  # its rope at byte 396
    assert "rope not 8-byte aligned" in (cuda_mla.unsupported(
        torch.zeros(1, 16, 448), three_groups, 64, three_groups.page_bytes(64), False) or "")
    with pytest.raises(ValueError, match=r"fp8-e8m0 records of 584 B need bulk_copy=True"):
        cuda_mla.build_for(RECORDS["fp8-e8m0"], split_sum=False)
    with pytest.raises(ValueError, match="sparse attention copies each key by one bulk copy"):
        cuda_mla.build_for(MXFP8, True, split_sum=False)
    assert "CUDA device" in (cuda_mla.unsupported(query, MXFP8, 64, MXFP8.page_bytes(64),
                                                  False) or "")


def test_sparse_key_slots_are_whole_16_byte_units() -> None:
    """A top-k build copies each key by itself in whole 16-byte units: 584-byte records take
    592-byte slots and a second mask word per stage (the keys shifted by 8 bytes); records of
    a multiple of 16 bytes keep their size and one mask word."""
    e8m0, fp8 = RECORDS["fp8-e8m0"], RECORDS["fp8"]
    dense, sparse = cuda_mla.build_for(e8m0), cuda_mla.build_for(e8m0, True)
    assert (cuda_mla.key_slot_bytes(dense), cuda_mla.key_slot_bytes(sparse)) == (584, 592)
    stages, tile = sparse.stages, sparse.tile
    assert cuda_mla.shared_bytes(sparse) - cuda_mla.shared_bytes(dense) == \
        stages * tile * 8 + stages * 8
    fp8_dense, fp8_sparse = cuda_mla.build_for(fp8), cuda_mla.build_for(fp8, True)
    assert cuda_mla.key_slot_bytes(fp8_sparse) == 656
    assert cuda_mla.shared_bytes(fp8_sparse) - cuda_mla.shared_bytes(fp8_dense) == \
        fp8_sparse.stages * 4


def test_forcing_the_kernel_where_it_cannot_run_raises() -> None:
    from kernelbay_attn_flashmla.triton_mla import mla_decode

    case = _case(MXFP8, [5], [1], 16, 16, seed=0, device="cpu")
    with pytest.raises(ValueError, match=r"CUDA MLA decode kernel cannot run.*CUDA device"):
        mla_decode(case.query, case.cache, MXFP8, 16, case.meta, 0.1, kernel="cuda")
    bf16 = _case(RECORDS["bf16"], [5], [1], 16, 16, seed=0, device="cpu")
    with pytest.raises(ValueError, match=r"cannot run.*record kind 'bf16'"):
        mla_decode(bf16.query, bf16.cache, RECORDS["bf16"], 16, bf16.meta, 0.1, kernel="cuda")
    with pytest.raises(ValueError, match=r"kernel=.cutlass.; valid"):
        mla_decode(case.query, case.cache, MXFP8, 16, case.meta, 0.1, kernel="cutlass")


def test_explain_names_the_decode_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    from kernelbay import AttentionRequest, cuda_jit, parse_device
    from kernelbay_attn_flashmla.triton_backend import MLATritonAttention

    def note(kind: str, nvrtc: str | None = "/lib/libnvrtc.so", **extra: Any) -> str:
        monkeypatch.setattr(cuda_jit, "find_nvrtc", lambda: nvrtc)
        rank = RECORDS[kind].kv_lora_rank
        request = AttentionRequest("mla", 16, 1, 192, 128, rank, 64, kv_cache=kind,
                                   page_size=64, **extra)
        verdict = MLATritonAttention.can_implement(request, parse_device("sm_90"))
        assert verdict.accepted
        return " ".join(verdict.notes)

    for kind in KINDS:
        assert "decode: CUDA kernel (NVRTC)" in note(kind)
    assert "no NVRTC on this machine" in note("mxfp8", nvrtc=None)
    assert "float16 queries" in note("fp8", dtype="float16")
    assert "decode: CUDA kernel (NVRTC)" in note("fp8", sparse_topk=64)
    assert "decode: CUDA kernel (NVRTC)" in note("fp8-e8m0", sparse_topk=64)
    assert note("bf16") == "decode: Triton kernel"



def test_a_build_failure_warns_once_and_leaves_the_call_to_triton(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """When a build does not compile or load (an architecture NVRTC does not know, more
    shared memory than the device has, a driver older than the cubin), the call warns,
    returns nothing (the Triton kernel then serves it), and that build is marked on that
    device so that later calls skip it with the reason; other builds stay on. Forced, the
    error propagates."""
    from kernelbay.cuda_jit import CudaJitError
    from kernelbay_attn_flashmla import triton_mla

    def failing(build: Any, device: int) -> None:
        raise CudaJitError("NVRTC could not compile mla_decode_mx for sm_99: unknown arch")

    monkeypatch.setattr(cuda_mla, "_BROKEN", {})
    monkeypatch.setattr(cuda_mla, "unsupported", lambda *a: None)
    monkeypatch.setattr(cuda_mla, "decode_kernel", failing)
    case = _case(MXFP8, [40], [1], 16, 16, seed=1, device="cpu")
    flat = case.cache.view(-1)
    call = (case.query, flat, MXFP8.page_bytes(16), MXFP8, 16, case.meta, 0.1, 2, None, None,
            None)
    with pytest.raises(CudaJitError, match="unknown arch"):
        triton_mla._decode_cuda(*call, forced=True, build={})
    with pytest.warns(RuntimeWarning, match="CUDA MLA decode kernel is off on cuda:0.*sm_99"):
        assert triton_mla._decode_cuda(*call, forced=False, build={}) is None
    assert "unknown arch" in str(cuda_mla.broken_reason(0, cuda_mla.build_for(MXFP8)))
    assert cuda_mla.broken_reason(0, cuda_mla.build_for(MXFP8, tile=32)) is None
    with pytest.raises(ValueError, match=r"its build failed on this device: .*unknown arch"):
        triton_mla._decode_cuda(*call, forced=True, build={})


def test_an_unaligned_cache_or_record_is_refused() -> None:
    from kernelbay_attn_flashmla.records import MLARecord, RecordField

    query = torch.zeros(1, 16, 512, dtype=torch.bfloat16)
    pool = torch.zeros(4 * MXFP8.page_bytes(16) + 8, dtype=torch.uint8)
    cache = pool[8:] if pool.data_ptr() % 16 == 0 else pool[:-8]
    assert cache.data_ptr() % 16
    reason = cuda_mla.unsupported(query, MXFP8, 16, MXFP8.page_bytes(16), False, 0.1, 16,
                                  cache)
    assert "not 16-byte aligned" in (reason or "")
    # a hand-built MXFP8 record with its scales first: the kernel reads values from byte 0
    moved = MLARecord("mxfp8", 448, 64, (RecordField("scales", 0, "float8_e8m0fnu", 16),
                                         RecordField("values", 16, "float8_e4m3fn", 512)), 32)
    assert "values do not start at byte 0" in (
        cuda_mla.unsupported(query, moved, 16, moved.page_bytes(16), False) or "")


# --- GPU ---------------------------------------------------------------------------------


#: The build mla_decode prefers for the page size (32-key tiles on pages of 32 keys or more,
#: else 16), the 16-key build, the one-phase score sum (per-thread copies), the query in
#: shared memory with four CTAs per SM, 32-key tiles by per-thread copies, and every warp
#: running the whole softmax (no lazy max) with 32- and 16-key tiles.
BUILDS: dict[str, dict[str, Any]] = {
    "default": {}, "tile16": {"tile": 16}, "one-phase-sum": {"split_sum": False},
    "query-in-shared": {"min_blocks": 4, "query_in_shared": True},
    "thread-copies-32": {**cuda_mla.preferred_build(64), "bulk_copy": False},
    "eager-max": {**cuda_mla.preferred_build(64), "lazy_max": False},
    "eager-max-16": {"tile": 16, "lazy_max": False}}


def _compare(case: Any, *, splits: int | None, window: int | None = None,
             atol: float = 3e-2, build: str = "default", kernel: str = "cuda",
             topk: torch.Tensor | None = None) -> None:
    from kernelbay_attn_flashmla.triton_mla import mla_decode

    scale = 1 / math.sqrt(192)
    out, lse = mla_decode(case.query, case.cache, case.record, case.page, case.meta, scale,
                          num_splits=splits, sliding_window=window, kernel=kernel,
                          cuda_build=BUILDS[build] if kernel == "cuda" else None,
                          topk_indices=topk)
    ref, ref_lse = mla_attention(case.query, case.cache, case.record, case.page, case.meta,
                                 scale, sliding_window=window, topk_indices=topk)
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=atol)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=atol, rtol=atol)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("build", sorted(BUILDS))
@pytest.mark.parametrize("heads", [16, 20, 128])
def test_decode_matches_reference_on_gpu(heads: int, build: str, kind: str) -> None:
    if not _builds(RECORDS[kind], **BUILDS[build]):
        pytest.skip(f"{kind} records take whole-tile bulk copies only")
    lengths = [1, 700, 4099, 64, 2500, 129, 16, 17, 33]
    case = _case(RECORDS[kind], lengths, [1] * len(lengths), heads, 64, seed=21, device="cuda",
                 writer="triton")
    for splits in (None, 1, 7):
        _compare(case, splits=splits, build=build)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("build", sorted(BUILDS))
def test_prefill_window_pages_and_unwritten_slots_on_gpu(build: str, kind: str) -> None:
    record = RECORDS[kind]
    if not _builds(record, **BUILDS[build]):
        pytest.skip(f"{kind} records take whole-tile bulk copies only")
    # the default build: 16-key tiles on the first page size, its 32-key ones on the other
    for page in ((32, 64) if BUILDS[build].get("tile") == 32 else (16, 64)):
        case = _case(record, [300, 2000, 33], [17, 40, 33], 16, page, seed=22, device="cuda",
                     writer="triton")
        # slots never written hold NaN codes and scales: masked keys must not read them
        written = case.cache.clone()
        case.cache.fill_(0xFF)
        from kernelbay_attn_flashmla.mla import token_view

        keep = token_view(written, record, page).ne(0).any(-1)
        view = token_view(case.cache, record, page)
        view[keep] = token_view(written, record, page)[keep]
        _compare(case, splits=4, build=build)
        _compare(case, splits=None, window=128, build=build)
        _compare(case, splits=1, window=5, build=build)


def _topk(lengths: list[int], new: list[int], k: int, gen: torch.Generator) -> torch.Tensor:
    """Top-k lists ``[T, k]`` for a case's query tokens: distinct positions of the token's
    sequence (later ones than its own too, which causality masks), unused entries (-1) in
    the middle and at the end, a token with no entry at all."""
    rows = []
    for n, m in zip(lengths, new, strict=True):
        for _ in range(m):
            row = torch.full((k,), -1, dtype=torch.int32)
            chosen = torch.randperm(n, generator=gen)[:k - k // 4].int()
            row[:len(chosen)] = chosen
            row[torch.randperm(k, generator=gen)[:k // 8]] = -1
            rows.append(row)
    rows[-1][:] = -1
    return torch.stack(rows)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("build", ["default", "tile16", "eager-max", "eager-max-16"])
def test_sparse_top_k_decode_and_prefill_match_reference_on_gpu(build: str, kind: str) -> None:
    # Each query attends the keys its top-k list names (duplicates none, unused -1): one
    # token per sequence and prefill tokens whose lists name later positions, with windows and
    # split counts; a token whose list is empty gets o = 0 and lse = -inf.
    gen = torch.Generator().manual_seed(27)
    for lengths, new in (([700, 4099, 64, 2500, 33], [1, 1, 1, 1, 1]),
                         ([300, 2000, 40], [17, 40, 33])):
        case = _case(RECORDS[kind], lengths, new, 16, 64, seed=28, device="cuda",
                     writer="triton")
        for k in (64, 600):
            topk = _topk(lengths, new, k, gen).cuda()
            for splits in (None, 1, 5):
                _compare(case, splits=splits, build=build, topk=topk)
            _compare(case, splits=3, window=200, build=build, topk=topk)


#: Scale bytes of the E8M0 kinds: the subnormal 2^-127, small, typical, the last one a single
#: factor covers (134), the first that needs a second (135), large but finite in bfloat16.
E8M0_BYTES = (0, 1, 20, 118, 127, 134, 135, 150, 200, 246)
#: float32 multipliers of fp8 records: subnormal, the smallest normal, small, the writer's
#: 1 / 448 for an amax of 1, ordinary, large but finite in bfloat16 after x 448.
FP32_SCALES = (1e-39, 2.0 ** -126, 1e-20, 1 / 448, 0.37, 1.0, 3.3e3, 1e30, 5e35)


def _exact_records(kind: str, seqs: int, gen: torch.Generator,
                   scale_pick: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One record per sequence holding every E4M3 code but the NaNs (the first 256 values of
    each record in order, the rest random) under scales drawn from ``E8M0_BYTES`` /
    ``FP32_SCALES`` (``scale_pick``: their indices, else random), a random bfloat16 rope
    where the kind keeps one, and the latent the kernel must return for it: code x scale
    rounded to bfloat16 (fp8: the float32 multiplier enters the value product as a bfloat16,
    so code x bfloat16(scale), exact in float32, rounded once)."""
    from kernelbay_attn_flashmla.codec import write_field

    record = RECORDS[kind]
    values = record.field("values" if kind == "mxfp8" else "nope")
    scales = record.field("scales" if kind == "mxfp8" else "nope_scale")
    codes = torch.randint(0, 256, (seqs, values.count), generator=gen,
                          dtype=torch.int32).to(torch.uint8)
    codes[:, :256] = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # the NaN codes
    table = torch.tensor(FP32_SCALES if kind == "fp8" else E8M0_BYTES,
                         dtype=torch.float32 if kind == "fp8" else torch.uint8)
    if scale_pick is None:
        scale_pick = torch.randint(0, len(table), (seqs, scales.count), generator=gen)
    chosen = table[scale_pick]
    out = torch.zeros(seqs, record.bytes_per_token, dtype=torch.uint8)
    write_field(out, values, codes.view(torch.float8_e4m3fn))
    write_field(out, scales, chosen)
    if kind != "mxfp8":
        rope = torch.randn(seqs, record.rope_dim, generator=gen).to(torch.bfloat16)
        write_field(out, record.field("rope"), rope)
    group = values.count // scales.count
    if kind == "fp8":
        factor = chosen.to(torch.bfloat16).float()
    else:
        factor = torch.exp2(chosen.float() - 127)
    want = codes.view(torch.float8_e4m3fn).float() * factor.repeat_interleave(group, dim=1)
    return out, want.to(torch.bfloat16)[:, :record.kv_lora_rank]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_single_key_attention_decodes_every_code_exactly_on_gpu(kind: str) -> None:
    # One key per sequence: the output is that key's decoded latent (probability exactly 1),
    # so every E4M3 code under every kind of scale must come out as _exact_records says.
    from kernelbay_attn_flashmla.mla import token_view
    from kernelbay_attn_flashmla.triton_mla import mla_decode

    record = RECORDS[kind]
    page, seqs = 16, 64
    records, want = _exact_records(kind, seqs, torch.Generator().manual_seed(23))
    cache = torch.zeros(seqs, record.page_bytes(page), dtype=torch.uint8)
    token_view(cache, record, page)[:, 0] = records
    meta = AttentionMetadata(torch.arange(seqs + 1, dtype=torch.int32).cuda(),
                             torch.ones(seqs, dtype=torch.int32).cuda(),
                             torch.arange(seqs, dtype=torch.int32).view(seqs, 1).cuda(),
                             torch.zeros(seqs).cuda())
    query = torch.zeros(seqs, 16, record.latent_dim, dtype=torch.bfloat16, device="cuda")
    out, lse = mla_decode(query, cache.cuda(), record, page, meta, 0.1, kernel="cuda",
                          num_splits=1)
    got = out.cpu()
    assert torch.equal(got, want[:, None, :].expand_as(got))
    assert torch.equal(lse.cpu(), torch.zeros(seqs, 16))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("build", "page"), [("default", 16), ("default", 32),
                                             ("tile16", 32), ("thread-copies-32", 32),
                                             ("default", 64), ("eager-max", 64),
                                             ("eager-max-16", 32)])
def test_full_tiles_decode_every_code_exactly_on_gpu(kind: str, build: str, page: int) -> None:
    # A page of copies of one record per sequence (whole tiles, no masked key: the copies'
    # and the decode's main path) with typical scales and, in half of the sequences, one
    # block with a tiny or a large one (E8M0 byte 135 is the first needing a second factor):
    # with a zero query each key has probability 1/page, and the sum of the equal products
    # is the decoded value exactly.
    from kernelbay_attn_flashmla.mla import token_view
    from kernelbay_attn_flashmla.triton_mla import mla_decode

    record = RECORDS[kind]
    if not _builds(record, **BUILDS[build]):
        pytest.skip(f"{kind} records take whole-tile bulk copies only")
    seqs = 48
    gen = torch.Generator().manual_seed(24)
    groups = record.field("scales" if kind == "mxfp8" else "nope_scale").count
    # typical scales: E8M0 bytes 118..134 (indices 3..5), multipliers 1/448..3.3e3 (3..6)
    pick = torch.randint(3, 6 if kind != "fp8" else 7, (seqs, groups), generator=gen)
    # (the largest multiplier, 5e35, would overflow float32 summed over a page: 1e30)
    edges = torch.tensor([0, 1, 6, 7] if kind == "fp8" else [0, 2, 6, 8])
    pick[seqs // 2:, groups // 3] = edges[torch.arange(seqs - seqs // 2) % len(edges)]
    records, want = _exact_records(kind, seqs, gen, pick)
    cache = torch.zeros(seqs, record.page_bytes(page), dtype=torch.uint8)
    token_view(cache, record, page)[:] = records[:, None, :]
    meta = AttentionMetadata(torch.arange(seqs + 1, dtype=torch.int32).cuda(),
                             torch.full((seqs,), page, dtype=torch.int32).cuda(),
                             torch.arange(seqs, dtype=torch.int32).view(seqs, 1).cuda(),
                             torch.zeros(seqs).cuda())
    query = torch.zeros(seqs, 16, record.latent_dim, dtype=torch.bfloat16, device="cuda")
    out, lse = mla_decode(query, cache.cuda(), record, page, meta, 0.1, kernel="cuda",
                          num_splits=1, cuda_build=BUILDS[build])
    got = out.cpu()
    assert torch.equal(got, want[:, None, :].expand_as(got))
    torch.testing.assert_close(lse.cpu(), torch.full((seqs, 16), math.log(float(page))))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("build", ["default", "tile16", "thread-copies-32", "eager-max",
                                   "eager-max-16", "triton"])
def test_queries_of_extreme_magnitude_on_gpu(build: str, kind: str) -> None:
    # Heads of 2^30 and 2^-30 beside ordinary ones and a zero head: scores near 2^36 check
    # that the largest probability is exactly 1 (exp2 of a fused s * c - max exceeded it
    # by half an ulp of the maximum, infinite there), tiny ones that nothing underflows.
    if build != "triton" and not _builds(RECORDS[kind], **BUILDS[build]):
        pytest.skip(f"{kind} records take whole-tile bulk copies only")
    case = _case(RECORDS[kind], [700, 40, 2100], [1, 1, 1], 16, 64, seed=25, device="cuda",
                 writer="triton")
    for factor in (2.0 ** 30, 2.0 ** -30):
        query = case.query.clone()
        query[:, 0] *= factor
        query[:, 3] = 0
        query[:, 9:] *= factor
        _compare(dataclasses.replace(case, query=query), splits=None,
                 build="default" if build == "triton" else build,
                 kernel="triton" if build == "triton" else "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("build", ["default", "tile16", "eager-max"])
def test_scores_rising_in_steps_on_gpu(build: str, kind: str) -> None:
    # Keys along one direction, their length stepping up every 256 positions: the scores of
    # heads with a positive query rise by about 15 (log2 units) at each step and stay flat in
    # between, those of negative heads fall. The lazy max then runs both of its paths in one
    # sequence: the full softmax (and the rescale) on the tiles that raise the max by more than
    # its slack, the shared probabilities on the others; splits cut the sequence anywhere.
    from kernelbay_attn_flashmla.triton_mla import mla_write

    record = RECORDS[kind]
    dim = record.latent_dim
    gen = torch.Generator().manual_seed(26)
    page, length, heads = 64, 2048, 16
    direction = torch.randn(dim, generator=gen)
    steps = 1.0 + 4.0 * (torch.arange(length) // 256).float()
    latent = (direction * steps[:, None] + 0.1 * torch.randn(length, dim, generator=gen))
    pages = length // page + 2
    order = torch.randperm(pages, generator=gen)[:length // page]
    cache = torch.zeros(pages, record.page_bytes(page), dtype=torch.uint8, device="cuda")
    pos = torch.arange(length)
    slots = order[pos // page].long() * page + pos % page
    mla_write(cache, record, page, latent.to("cuda", torch.bfloat16), slots.cuda())
    alpha = torch.linspace(-0.07, 0.07, heads) * (512 / dim) ** 0.5
    query = (alpha[:, None] * direction[None, :]).view(1, heads, dim)
    meta = AttentionMetadata(torch.tensor([0, 1], dtype=torch.int32).cuda(),
                             torch.tensor([length], dtype=torch.int32).cuda(),
                             order.view(1, -1).int().cuda(), torch.zeros(1).cuda())
    case = Case(record, page, cache, meta, query.to("cuda", torch.bfloat16), [length])
    for splits in (None, 1, 3):
        _compare(case, splits=splits, build=build)


@pytest.mark.gpu
@pytest.mark.parametrize(("kind", "kernel"), [("mxfp8", "cuda"), ("fp8", "cuda"),
                                              ("fp8-e8m0", "cuda"), ("bf16", "triton"),
                                              ("mxfp8", "triton")])
def test_split_decode_and_combine_as_programmatic_pair_on_gpu(
        kind: str, kernel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a CUDA graph the combine becomes a programmatic dependent of the split decode (one
    edge per call on sm_90, none below) and gives the bits of plain launches on fresh queries
    every replay: a combine reading partials before the decode finished would see the
    previous replay's."""
    from kernelbay.cuda_jit import programmatic_launch
    from kernelbay.testing.programmatic import check_programmatic_chain
    from kernelbay_attn_flashmla.triton_mla import mla_decode

    record = RECORDS[kind]
    case = _case(record, [700, 1300, 64], [1, 1, 1], 16, 64, seed=11, device="cuda")
    scale = 1 / math.sqrt(192)

    def layer(query: torch.Tensor) -> torch.Tensor:
        return mla_decode(query, case.cache, record, 64, case.meta, scale, num_splits=5,
                          kernel=kernel)[0]

    gen = torch.Generator().manual_seed(12)
    queries = [torch.randn(case.query.shape, generator=gen).to("cuda", torch.bfloat16)
               for _ in range(3)]
    edges = 1 if programmatic_launch(torch.cuda.current_device()) else 0
    check_programmatic_chain(monkeypatch, [layer], queries, edges=edges)
