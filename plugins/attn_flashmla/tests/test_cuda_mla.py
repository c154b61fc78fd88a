"""The CUDA MXFP8 decode kernel (``cuda_mla``) against the torch reference.

CPU: NVRTC compiles the source for sm_80 and sm_90 (on sm_90 the 16-key build with no local
memory, the 32-key one with at most 24 bytes), calls get the build they name or the page
size's preferred one, and the cases the kernel does not take are refused with their reason. GPU: decoding through single-key
attention is exact for every E4M3 code under every kind of scale byte; decode, prefill,
sliding windows, split counts, head counts and never-written (NaN) slots match the reference.
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


@pytest.mark.skipif(not nvrtc_available(), reason="needs NVRTC (nvidia-cuda-nvrtc)")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_source_compiles_without_local_memory(arch: str, tmp_path: Any,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from kernelbay.testing.cubins import cubin_resources

    monkeypatch.setenv("KERNELBAY_CACHE_DIR", str(tmp_path))
    for record in (MXFP8, record_for_dims("mxfp8", 480, 32)):
        for build in (cuda_mla.build_for(record), cuda_mla.build_for(record, stages=4, min_blocks=2),
                      cuda_mla.build_for(record, split_sum=False),
                      cuda_mla.build_for(record, lazy_max=False),
                      cuda_mla.build_for(record, **cuda_mla.preferred_build(64))):
            cubin = compile_cubin(cuda_mla._source(), "mla_decode_mx", arch,
                                  cuda_mla.build_options(build))
            assert cubin[:4] == b"\x7fELF"
            # on sm_90, the architecture they are tuned for, the 16-key build keeps everything
            # in registers and the 32-key one spills at most six loop-invariant registers
            # (other builds and sm_80 may spill more)
            if arch != "sm_90":
                continue
            usage = cubin_resources(cubin)
            if build == cuda_mla.build_for(record):
                assert "STACK:0 " in usage and "LOCAL:0 " in usage, usage
            elif build.tile == 32:
                stack = re.search(r"STACK:(\d+) ", usage)
                assert stack and int(stack.group(1)) <= 24 and "LOCAL:0 " in usage, usage


def test_calls_get_the_build_they_name_or_the_preferred_one() -> None:
    assert cuda_mla.call_build(64, None) == cuda_mla.preferred_build(64)
    assert cuda_mla.preferred_build(64)["tile"] == 32 and cuda_mla.call_build(16, {}) == {}
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
    query = torch.zeros(1, 16, 512, dtype=torch.bfloat16)
    assert "mxfp8" in (cuda_mla.unsupported(query, RECORDS["fp8"], 64, 36864, False) or "")
    assert "512 values" in (cuda_mla.unsupported(torch.zeros(1, 16, 80), record_for_dims(
        "mxfp8", 64, 16), 64, 8192, False) or "")
    assert "sparse" in (cuda_mla.unsupported(query, MXFP8, 64, MXFP8.page_bytes(64), True)
                        or "")
    assert "CUDA device" in (cuda_mla.unsupported(query, MXFP8, 64, MXFP8.page_bytes(64),
                                                  False) or "")


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
        request = AttentionRequest("mla", 16, 1, 192, 128, 448, 64, kv_cache=kind,
                                   page_size=64, **extra)
        verdict = MLATritonAttention.can_implement(request, parse_device("sm_90"))
        assert verdict.accepted
        return " ".join(verdict.notes)

    assert "decode: CUDA MXFP8 kernel (NVRTC)" in note("mxfp8")
    assert "no NVRTC on this machine" in note("mxfp8", nvrtc=None)
    assert "float16 queries" in note("mxfp8", dtype="float16")
    assert "sparse top-k" in note("mxfp8", sparse_topk=64)
    assert "decode: Triton kernel" in note("fp8")


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
    call = (case.query, flat, MXFP8.page_bytes(16), MXFP8, 16, case.meta, 0.1, 2, False, None,
            None)
    with pytest.raises(CudaJitError, match="unknown arch"):
        triton_mla._decode_cuda(*call, forced=True, build={})
    with pytest.warns(RuntimeWarning, match="CUDA MXFP8 decode kernel is off on cuda:0.*sm_99"):
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
             atol: float = 3e-2, build: str = "default", kernel: str = "cuda") -> None:
    from kernelbay_attn_flashmla.triton_mla import mla_decode

    scale = 1 / math.sqrt(192)
    out, lse = mla_decode(case.query, case.cache, case.record, case.page, case.meta, scale,
                          num_splits=splits, sliding_window=window, kernel=kernel,
                          cuda_build=BUILDS[build] if kernel == "cuda" else None)
    ref, ref_lse = mla_attention(case.query, case.cache, case.record, case.page, case.meta,
                                 scale, sliding_window=window)
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=atol)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=atol, rtol=atol)


@pytest.mark.gpu
@pytest.mark.parametrize("build", sorted(BUILDS))
@pytest.mark.parametrize("heads", [16, 20, 128])
def test_decode_matches_reference_on_gpu(heads: int, build: str) -> None:
    lengths = [1, 700, 4099, 64, 2500, 129, 16, 17, 33]
    case = _case(MXFP8, lengths, [1] * len(lengths), heads, 64, seed=21, device="cuda",
                 writer="triton")
    for splits in (None, 1, 7):
        _compare(case, splits=splits, build=build)


@pytest.mark.gpu
@pytest.mark.parametrize("build", sorted(BUILDS))
def test_prefill_window_pages_and_unwritten_slots_on_gpu(build: str) -> None:
    # the default build: 16-key tiles on the first page size, its 32-key ones on the other
    for page in ((32, 64) if BUILDS[build].get("tile") == 32 else (16, 64)):
        case = _case(MXFP8, [300, 2000, 33], [17, 40, 33], 16, page, seed=22, device="cuda",
                     writer="triton")
        # slots never written hold NaN codes and scales: masked keys must not read them
        written = case.cache.clone()
        case.cache.fill_(0xFF)
        from kernelbay_attn_flashmla.mla import token_view

        keep = token_view(written, MXFP8, page).ne(0).any(-1)
        view = token_view(case.cache, MXFP8, page)
        view[keep] = token_view(written, MXFP8, page)[keep]
        _compare(case, splits=4, build=build)
        _compare(case, splits=None, window=128, build=build)
        _compare(case, splits=1, window=5, build=build)


@pytest.mark.gpu
def test_single_key_attention_decodes_every_code_exactly_on_gpu() -> None:
    # One key per sequence: the output is that key's decoded latent (probability exactly 1),
    # so every E4M3 code under every kind of scale byte (the subnormal 2^-127, small,
    # typical, the last one a single factor covers, the first that needs a second, large but
    # finite in bfloat16) must come out as code * 2^(byte - 127) rounded to bfloat16.
    from kernelbay_attn_flashmla.mla import token_view
    from kernelbay_attn_flashmla.triton_mla import mla_decode

    page, seqs = 16, 64
    gen = torch.Generator().manual_seed(23)
    codes = torch.randint(0, 256, (seqs, 512), generator=gen, dtype=torch.int32).to(torch.uint8)
    codes[:, :256] = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # the NaN codes
    scale_bytes = torch.tensor([0, 1, 20, 118, 127, 134, 135, 150, 200, 246], dtype=torch.uint8)
    scales = scale_bytes[torch.randint(0, len(scale_bytes), (seqs, 16), generator=gen)]
    cache = torch.zeros(seqs, MXFP8.page_bytes(page), dtype=torch.uint8)
    token_view(cache, MXFP8, page)[:, 0] = torch.cat([codes, scales], dim=1)
    meta = AttentionMetadata(torch.arange(seqs + 1, dtype=torch.int32).cuda(),
                             torch.ones(seqs, dtype=torch.int32).cuda(),
                             torch.arange(seqs, dtype=torch.int32).view(seqs, 1).cuda(),
                             torch.zeros(seqs).cuda())
    query = torch.zeros(seqs, 16, 512, dtype=torch.bfloat16, device="cuda")
    out, lse = mla_decode(query, cache.cuda(), MXFP8, page, meta, 0.1, kernel="cuda",
                          num_splits=1)
    factor = torch.exp2(scales.float() - 127).repeat_interleave(32, dim=1)
    want = (codes.view(torch.float8_e4m3fn).float() * factor).to(torch.bfloat16)[:, :448]
    got = out.cpu()
    assert torch.equal(got, want[:, None, :].expand_as(got))
    assert torch.equal(lse.cpu(), torch.zeros(seqs, 16))


@pytest.mark.gpu
@pytest.mark.parametrize(("build", "page"), [("default", 16), ("default", 32),
                                             ("tile16", 32), ("thread-copies-32", 32),
                                             ("default", 64), ("eager-max", 64),
                                             ("eager-max-16", 32)])
def test_full_tiles_decode_every_code_exactly_on_gpu(build: str, page: int) -> None:
    # A page of copies of one record per sequence (whole tiles, no masked key: the copies'
    # and the decode's main path) with typical scale bytes and, in half of the sequences,
    # one block with a tiny or a large byte (135 is the first needing a second factor): with
    # a zero query each key has probability 1/page, and the sum of the equal products is the
    # decoded value exactly.
    from kernelbay_attn_flashmla.mla import token_view
    from kernelbay_attn_flashmla.triton_mla import mla_decode

    seqs = 48
    gen = torch.Generator().manual_seed(24)
    codes = torch.randint(0, 256, (seqs, 512), generator=gen, dtype=torch.int32).to(torch.uint8)
    codes[:, :256] = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # the NaN codes
    inside = torch.tensor([113, 114, 120, 127, 133, 134], dtype=torch.uint8)
    edges = torch.tensor([0, 112, 135, 200], dtype=torch.uint8)
    scales = inside[torch.randint(0, len(inside), (seqs, 16), generator=gen)]
    scales[seqs // 2:, 5] = edges[torch.arange(seqs - seqs // 2) % len(edges)]
    cache = torch.zeros(seqs, MXFP8.page_bytes(page), dtype=torch.uint8)
    token_view(cache, MXFP8, page)[:] = torch.cat([codes, scales], dim=1)[:, None, :]
    meta = AttentionMetadata(torch.arange(seqs + 1, dtype=torch.int32).cuda(),
                             torch.full((seqs,), page, dtype=torch.int32).cuda(),
                             torch.arange(seqs, dtype=torch.int32).view(seqs, 1).cuda(),
                             torch.zeros(seqs).cuda())
    query = torch.zeros(seqs, 16, 512, dtype=torch.bfloat16, device="cuda")
    out, lse = mla_decode(query, cache.cuda(), MXFP8, page, meta, 0.1, kernel="cuda",
                          num_splits=1, cuda_build=BUILDS[build])
    factor = torch.exp2(scales.float() - 127).repeat_interleave(32, dim=1)
    want = (codes.view(torch.float8_e4m3fn).float() * factor).to(torch.bfloat16)[:, :448]
    got = out.cpu()
    assert torch.equal(got, want[:, None, :].expand_as(got))
    torch.testing.assert_close(lse.cpu(), torch.full((seqs, 16), math.log(float(page))))


@pytest.mark.gpu
@pytest.mark.parametrize("build", ["default", "tile16", "thread-copies-32", "eager-max",
                                   "eager-max-16", "triton"])
def test_queries_of_extreme_magnitude_on_gpu(build: str) -> None:
    # Heads of 2^30 and 2^-30 beside ordinary ones and a zero head: scores near 2^36 check
    # that the largest probability is exactly 1 (exp2 of a fused s * c - max exceeded it
    # by half an ulp of the maximum, infinite there), tiny ones that nothing underflows.
    case = _case(MXFP8, [700, 40, 2100], [1, 1, 1], 16, 64, seed=25, device="cuda",
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
@pytest.mark.parametrize("build", ["default", "tile16", "eager-max"])
def test_scores_rising_in_steps_on_gpu(build: str) -> None:
    # Keys along one direction, their length stepping up every 256 positions: the scores of
    # heads with a positive query rise by about 15 (log2 units) at each step and stay flat in
    # between, those of negative heads fall. The lazy max then runs both of its paths in one
    # sequence: the full softmax (and the rescale) on the tiles that raise the max by more than
    # its slack, the shared probabilities on the others; splits cut the sequence anywhere.
    from kernelbay_attn_flashmla.triton_mla import mla_write

    gen = torch.Generator().manual_seed(26)
    page, length, heads = 64, 2048, 16
    direction = torch.randn(512, generator=gen)
    steps = 1.0 + 4.0 * (torch.arange(length) // 256).float()
    latent = (direction * steps[:, None] + 0.1 * torch.randn(length, 512, generator=gen))
    pages = length // page + 2
    order = torch.randperm(pages, generator=gen)[:length // page]
    cache = torch.zeros(pages, MXFP8.page_bytes(page), dtype=torch.uint8, device="cuda")
    pos = torch.arange(length)
    slots = order[pos // page].long() * page + pos % page
    mla_write(cache, MXFP8, page, latent.to("cuda", torch.bfloat16), slots.cuda())
    alpha = torch.linspace(-0.07, 0.07, heads)
    query = (alpha[:, None] * direction[None, :]).view(1, heads, 512)
    meta = AttentionMetadata(torch.tensor([0, 1], dtype=torch.int32).cuda(),
                             torch.tensor([length], dtype=torch.int32).cuda(),
                             order.view(1, -1).int().cuda(), torch.zeros(1).cuda())
    case = Case(MXFP8, page, cache, meta, query.to("cuda", torch.bfloat16), [length])
    for splits in (None, 1, 3):
        _compare(case, splits=splits, build=build)


@pytest.mark.gpu
@pytest.mark.parametrize(("kind", "kernel"), [("mxfp8", "cuda"), ("bf16", "triton"),
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
