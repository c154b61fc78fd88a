"""mla-triton against the torch reference: cache writes bit for bit, decode within round-off.

CPU tests run the kernels under the Triton interpreter (tiny shapes: 2 heads, 64+16
latents); ``gpu`` tests run them compiled on CUDA at DeepSeek sizes (512+64 and the
FORMATS.md dims of each kind, page 64, 16 and 128 heads).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from kernelbay import AttentionRequest, parse_device
from kernelbay.layers import AttentionMetadata
from kernelbay.testing.interpreter import triton_interpreter_problem
from kernelbay_attn_flashmla.codec import encode_records
from kernelbay_attn_flashmla.mla import mla_attention, token_view
from kernelbay_attn_flashmla.records import RECORDS, MLARecord, record_for_dims
from kernelbay_attn_flashmla.triton_backend import MLATritonAttention

KINDS = sorted(RECORDS)
pytest.importorskip("triton")


@pytest.fixture
def interpret(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Run the kernels under the Triton interpreter for one test (skipped where this
    Triton's interpreter cannot run them)."""
    problem = triton_interpreter_problem()
    if problem is not None:
        pytest.skip(problem)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


@dataclass
class Case:
    record: MLARecord
    page: int
    cache: torch.Tensor
    meta: AttentionMetadata
    query: torch.Tensor
    lengths: list[int]


def _case(record: MLARecord, lengths: list[int], new: list[int], heads: int, page: int,
          seed: int, device: str, writer: str = "reference") -> Case:
    """Random latents written into randomly ordered pages (spare pages left in between)."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [math.ceil(n / page) for n in lengths]
    total = sum(pages_per_seq) + 3
    cache = torch.zeros(total, record.page_bytes(page), dtype=torch.uint8, device=device)
    order = torch.randperm(total, generator=gen)
    tables = torch.zeros(len(lengths), max(pages_per_seq) + 1, dtype=torch.int32)
    slots, latents = [], []
    used = 0
    for b, n in enumerate(lengths):
        tables[b, :pages_per_seq[b]] = order[used:used + pages_per_seq[b]]
        used += pages_per_seq[b]
        pos = torch.arange(n)
        slots.append(tables[b, pos // page].long() * page + pos % page)
        latent = torch.randn(n, record.latent_dim, generator=gen)
        latent[:, record.kv_lora_rank:] *= 2
        latents.append(latent)
    latent = torch.cat(latents).to(device=device, dtype=torch.bfloat16)
    slot = torch.cat(slots).to(device)
    if writer == "reference":
        view = token_view(cache, record, page)
        view[slot // page, slot % page] = encode_records(record, latent)
    else:
        from kernelbay_attn_flashmla.triton_mla import mla_write

        mla_write(cache, record, page, latent, slot)
    starts = torch.tensor([0, *itertools_accumulate(new)], dtype=torch.int32)
    query = torch.randn(sum(new), heads, record.latent_dim, generator=gen)
    meta = AttentionMetadata(starts.to(device), torch.tensor(lengths, device=device),
                             tables.to(device), torch.zeros(sum(new), device=device))
    return Case(record, page, cache, meta, query.to(device=device, dtype=torch.bfloat16),
                lengths)


def itertools_accumulate(values: list[int]) -> list[int]:
    """Running sums of ``values``."""
    out, total = [], 0
    for v in values:
        total += v
        out.append(total)
    return out


def _compare(case: Case, *, splits: int | None, atol: float, topk: torch.Tensor | None = None,
             window: int | None = None, scale: float = 0.08, **launch: object) -> None:
    from kernelbay_attn_flashmla.triton_mla import mla_decode

    out, lse = mla_decode(case.query, case.cache, case.record, case.page, case.meta, scale,
                          num_splits=splits, topk_indices=topk, sliding_window=window,
                          **launch)  # type: ignore[arg-type]
    ref, ref_lse = mla_attention(case.query, case.cache, case.record, case.page, case.meta,
                                 scale, topk_indices=topk, sliding_window=window)
    assert out.dtype == case.query.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=atol)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=atol, rtol=atol)


# --- interpreter (CPU) ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_write_kernel_is_bit_exact(kind: str, interpret: None) -> None:
    from kernelbay_attn_flashmla.triton_mla import mla_write

    record = record_for_dims(kind, 64, 16)
    page = 4
    gen = torch.Generator().manual_seed(7)
    latent = torch.randn(12, record.latent_dim, generator=gen) * 3
    latent[1] = 0.0                                              # all-zero groups
    latent[2] = torch.randn(record.latent_dim, generator=gen).sign() * 448.0
    latent[3] *= 1e-30                                           # tiny amax
    latent[4, ::3] = 2.0**-9                                     # E4M3 subnormal range
    latent[5] *= 1e4
    latent[6, 0] = -0.0
    slots = torch.randperm(6 * page, generator=gen)[:12]
    slots[11] = -1                                               # skipped
    got = torch.zeros(6, record.page_bytes(page), dtype=torch.uint8)
    mla_write(got, record, page, latent, slots)
    want = torch.zeros_like(got)
    keep = slots >= 0
    view = token_view(want, record, page)
    view[slots[keep] // page, slots[keep] % page] = encode_records(record, latent[keep])
    assert torch.equal(got, want)


@pytest.mark.parametrize("kind", KINDS)
def test_decode_matches_reference_interpreted(kind: str, interpret: None) -> None:
    record = record_for_dims(kind, 64, 16)
    case = _case(record, [5, 70, 33, 1], [1, 1, 1, 1], 2, 16, seed=1, device="cpu",
                 writer="triton")
    for splits in (1, 3, 8):
        _compare(case, splits=splits, atol=2e-2)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("page", [16, 32])
def test_tiles_within_pages_interpreted(kind: str, page: int, interpret: None) -> None:
    # 16-key tiles on 16- and 32-key pages: each tile lies in one page and reads its
    # block-table entry once; with a sliding window the first tile starts before the
    # window (the keys before it masked), and splits end mid-page.
    record = record_for_dims(kind, 64, 16)
    case = _case(record, [5, 70, 33, 100], [1, 1, 1, 1], 2, page, seed=6, device="cpu",
                 writer="triton")
    for splits, window in ((1, None), (3, None), (2, 21), (5, 40)):
        _compare(case, splits=splits, atol=2e-2, window=window, block_n=16)


LAYOUTS = {"flat": {"chunked": False}, "chunked": {"chunked": True},
           "grouped": {"grouped": True}, "flat-no-prefetch": {"chunked": False,
                                                              "reg_prefetch": False}}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_wide_latents_every_layout_interpreted(kind: str, layout: str,
                                               interpret: None) -> None:
    from kernelbay_attn_flashmla.triton_mla import launch_constants, mla_decode

    if kind == "bf16" and layout in ("grouped", "flat-no-prefetch"):
        pytest.skip("bf16 records have no scales: the same kernel as flat")

    # 192+16: four 64-column chunks, the last one partly past the latent; fp8 groups of 64,
    # mxfp8 blocks of 16. 256+32: fp8 groups of 128 span two chunks.
    for rank, rope in ((192, 16), (256, 32)):
        record = record_for_dims(kind, rank, rope)
        case = _case(record, [40, 9], [1, 1], 3, 16, seed=rank, device="cpu")
        if layout == "grouped":
            assert launch_constants(record, 3, 16, record.page_bytes(16),
                                    grouped=True)["GROUPED"]
        out, lse = mla_decode(case.query, case.cache, record, 16, case.meta, 0.05,
                              num_splits=2, **LAYOUTS[layout])
        ref, ref_lse = mla_attention(case.query, case.cache, record, 16, case.meta, 0.05)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse, ref_lse, atol=2e-2, rtol=2e-2)


def test_groups_across_the_nope_rope_boundary_interpreted(interpret: None) -> None:
    # 56+8 MXFP8: blocks of 32 straddle the nope/rope boundary (the rope's scales are
    # gathered per element), latent and rope widths not powers of two.
    record = record_for_dims("mxfp8", 56, 8)
    assert record.group_size == 32 and record.kv_lora_rank % 32
    case = _case(record, [37, 3], [1, 1], 3, 4, seed=5, device="cpu", writer="triton")
    _compare(case, splits=2, atol=2e-2)
    _compare(case, splits=2, atol=2e-2, grouped=True)


def test_prefill_window_and_sparse_interpreted(interpret: None) -> None:
    record = record_for_dims("mxfp8", 64, 16)
    case = _case(record, [9, 40], [3, 5], 2, 8, seed=2, device="cpu")
    _compare(case, splits=2, atol=2e-2)
    _compare(case, splits=3, atol=2e-2, window=7)
    gen = torch.Generator().manual_seed(3)
    topk = torch.stack([torch.randperm(9, generator=gen)[:6] for _ in range(3)]
                       + [torch.randperm(40, generator=gen)[:6] for _ in range(5)]).int()
    topk[0, :] = -1                                             # a query with no key
    topk[4, 2] = -1
    _compare(case, splits=2, atol=2e-2, topk=topk)
    _compare(case, splits=2, atol=2e-2, topk=topk, grouped=True)


@pytest.mark.parametrize("num_sms", [1, 132])
@pytest.mark.parametrize(("splits", "rank"), [(3, 64), (24, 448), (40, 130)])
def test_combine_matches_reference_interpreted(splits: int, rank: int, num_sms: int,
                                               interpret: None) -> None:
    """The combine kernel against ``combine_splits`` on random partials: split counts and
    ranks that are not powers of two (the kernel pads both), splits without keys (lse -inf,
    partial 0), a head whose splits are all empty (out 0, lse -inf), and strided partials (a
    view of a larger buffer); whole rows one split at a time (a program per SM or more) and
    blocks of splits x 128 columns (fewer programs than SMs)."""
    from kernelbay_attn_flashmla.mla import combine_splits
    from kernelbay_attn_flashmla.triton_mla import _combine

    gen = torch.Generator().manual_seed(splits * 1000 + rank)
    tokens, heads = 3, 2
    big = torch.randn(tokens, splits, heads + 1, rank + 8, generator=gen)
    part = big[:, :, 1:, 3:rank + 3]
    plse = torch.randn(tokens, splits, heads, generator=gen) * 4
    empty = torch.rand(tokens, splits, heads, generator=gen) < 0.3
    empty[1, :, 0] = True                      # token 1, head 0: no key in any split
    plse[empty] = float("-inf")
    part[empty] = 0.0
    out = torch.empty(tokens, heads, rank, dtype=torch.bfloat16)
    lse = torch.empty(tokens, heads)
    _combine(part, plse, out, lse, splits, num_sms=num_sms)
    want, want_lse = combine_splits(part.permute(1, 0, 2, 3), plse.permute(1, 0, 2))
    torch.testing.assert_close(out.float(), want.bfloat16().float(), atol=1e-2, rtol=1e-2)
    assert torch.equal(out[1, 0].float(), torch.zeros(rank))
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse[finite], want_lse[finite], atol=1e-5, rtol=1e-5)


def test_backend_on_cpu_interpreter_matches_reference(interpret: None) -> None:
    record = record_for_dims("fp8", 64, 16)
    request = AttentionRequest("mla", 2, 1, 48, 32, 64, 16, kv_cache="fp8", page_size=16)
    backend = MLATritonAttention(request)
    case = _case(record, [20, 3], [1, 1], 2, 16, seed=4, device="cpu", writer="triton")
    out = backend.forward(case.query, case.cache, case.meta, 0.1, num_splits=2)
    ref = mla_attention(case.query, case.cache, record, 16, case.meta, 0.1)[0]
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


# --- capability --------------------------------------------------------------------------


def _request(**kw: object) -> AttentionRequest:
    base: dict[str, object] = dict(kv_cache="mxfp8", page_size=64)
    base.update(kw)
    return AttentionRequest("mla", 16, 1, 192, 128, 448, 64, **base)  # type: ignore[arg-type]


def test_can_implement_names_each_rejection() -> None:
    h200 = parse_device("sm_90")
    assert MLATritonAttention.can_implement(_request(), h200)
    for kind in KINDS:
        rec = RECORDS[kind]
        r = AttentionRequest("mla", 128, 1, 192, 128, rec.kv_lora_rank, rec.rope_dim,
                             kv_cache=kind, page_size=64)
        assert MLATritonAttention.can_implement(r, h200)
    cases = {
        "compute capability >= 9.0, device is cuda sm_80 (compute capability 8.0)":
            (_request(), parse_device("sm_80")),
        "device is cpu": (_request(), parse_device("cpu")),
        "page_size a power of two (tiles index pages by shift), request has 24":
            (_request(page_size=24), h200),
        "query dtypes ['bfloat16', 'float16'], request has 'float32'":
            (_request(dtype="float32"), h200),
        "kv_lora_rank in [16, 1024], request has 2048":
            (AttentionRequest("mla", 16, 1, 192, 128, 2048, 64, kv_cache="bf16"), h200),
        "request asks 'fp4'": (_request(kv_cache="fp4"), h200),
    }
    for text, (request, device) in cases.items():
        verdict = MLATritonAttention.can_implement(request, device)
        assert not verdict.accepted and text in verdict.reason, (text, verdict.reason)


def test_priority_above_reference() -> None:
    from kernelbay_attn_flashmla.backend import MLAReferenceAttention

    assert MLATritonAttention.priority > MLAReferenceAttention.priority


# --- GPU ---------------------------------------------------------------------------------


#: The extra flat launch the 16-head GPU case checks (one the bench sweeps).
GPU_LAUNCH = {"block_n": 64, "num_warps": 8, "l2_ahead": 0, "f16_dot": True}


@pytest.fixture(scope="session")
def gpu_kernels() -> None:
    """Compile the GPU tests' decode and write configurations in parallel first (into
    Triton's on-disk cache); the tests then load them instead of compiling one by one."""
    from kernelbay_attn_flashmla.triton_warm import WarmJob, warm

    jobs = []
    for kind in KINDS:
        rec = RECORDS[kind]
        for heads in (16, 128):
            for splits in (2, 1):
                jobs.append(WarmJob(kind, rec.kv_lora_rank, rec.rope_dim, heads, {}, splits,
                                    write=heads == 16 and splits == 2))
        jobs.append(WarmJob(kind, rec.kv_lora_rank, rec.rope_dim, 16, GPU_LAUNCH))
        if rec.latent_dim != 576:
            jobs.append(WarmJob(kind, 512, 64, 16, {}, write=True))
    warm(jobs)


# Each distinct launch compiles (seconds each on the GPU host), so the GPU cases are chosen
# to cover every code path once: each kind at its FORMATS.md dims and 16 / 128 heads (flat
# and chunked nope layouts), one split (final output written by the split kernel) and many
# (partials + combine), the 512+64 dims where they differ from FORMATS.md, and one other
# flat launch the bench sweeps (64-key tiles, 8 warps, no L2 prefetch, float16 dots).
@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("heads", [16, 128])
def test_decode_matches_reference_on_gpu(kind: str, heads: int, gpu_kernels: None) -> None:
    record = RECORDS[kind]
    lengths = [1, 700, 4099, 64, 2500, 129]
    case = _case(record, lengths, [1] * len(lengths), heads, 64, seed=11, device="cuda",
                 writer="triton")
    for splits in (None, 1):
        _compare(case, splits=splits, atol=3e-2, scale=1 / math.sqrt(192))
    if kind == "mxfp8":  # the CUDA kernel serves these by default; the Triton one as well
        _compare(case, splits=None, atol=3e-2, scale=1 / math.sqrt(192), kernel="triton")
    if heads != 16:
        return
    # float16 dots (quantized kinds; bf16 records ignore the option).
    _compare(case, splits=7, atol=3e-2, scale=1 / math.sqrt(192),
             **GPU_LAUNCH)  # type: ignore[arg-type]
    wide = record_for_dims(kind, 512, 64)
    if wide.latent_dim != record.latent_dim:
        case = _case(wide, lengths, [1] * len(lengths), heads, 64, seed=14, device="cuda",
                     writer="triton")
        _compare(case, splits=7, atol=3e-2, scale=1 / math.sqrt(192))


def _check_e8m0_tile_decode(device: str) -> None:
    """Every E4M3 code under every kind of E8M0 byte (the subnormal 2^-127, small, typical,
    the last one a single factor covers on the GPU, the first that needs the second, the
    largest) decodes to E4M3 * 2^(byte - 127) exactly, as torch's float8 and float32 give
    it (rounded to bfloat16 on the GPU, where the tile is bfloat16)."""
    import importlib

    import _decode_kernel
    from kernelbay_attn_flashmla.triton_mla import _kernels

    # Both modules jitted for this test's mode (TRITON_INTERPRET or not).
    _kernels()
    e8m0_words_kernel = importlib.reload(_decode_kernel).e8m0_words_kernel
    group, c_pad, rows = 32, 256, 16
    scales = torch.tensor([0, 1, 20, 118, 127, 134, 135, 150, 200, 254], dtype=torch.uint8)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(rows, 1)
    codes = codes[:, torch.randperm(256, generator=torch.Generator().manual_seed(3))]
    raw = scales[torch.arange(rows * (c_pad // group)) % len(scales)].view(rows, -1)
    out = torch.empty(rows, c_pad, dtype=torch.float32, device=device)
    e8m0_words_kernel[(1,)](codes.to(device).view(torch.int32), raw.to(device), out, rows,
                            c_pad, group, device == "cuda")
    factor = torch.exp2(raw.float() - 127).repeat_interleave(group, dim=1)
    expected = codes.view(torch.float8_e4m3fn).float() * factor
    if device == "cuda":
        expected = expected.to(torch.bfloat16).float()
    finite = (codes & 0x7F) != 0x7F  # the two NaN codes: never written, decoded finite
    got = out.cpu()[finite]
    assert torch.equal(got, expected[finite])
    assert torch.equal(torch.signbit(got), torch.signbit(expected[finite]))


def test_e8m0_tile_decode_is_exact_interpreted(interpret: None) -> None:
    _check_e8m0_tile_decode("cpu")


@pytest.mark.gpu
def test_e8m0_tile_decode_is_exact_on_gpu(gpu_kernels: None) -> None:
    _check_e8m0_tile_decode("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_write_kernel_is_bit_exact_on_gpu(kind: str, gpu_kernels: None) -> None:
    from kernelbay_attn_flashmla.triton_mla import mla_write

    for record in (RECORDS[kind], record_for_dims(kind, 512, 64)):
        page = 64
        gen = torch.Generator().manual_seed(5)
        latent = torch.randn(3000, record.latent_dim, generator=gen) * 4
        latent[0] = 0.0
        latent[1] *= 1e-20
        latent[2] = 448.0
        slots = torch.randperm(60 * page, generator=gen)[:3000]
        got = torch.zeros(60, record.page_bytes(page), dtype=torch.uint8, device="cuda")
        mla_write(got, record, page, latent.cuda().bfloat16(), slots.cuda())
        want = torch.zeros_like(got)
        view = token_view(want, record, page)
        view[slots.cuda() // page, slots.cuda() % page] = encode_records(
            record, latent.cuda().bfloat16())
        bad = (got != want).nonzero()
        assert bad.numel() == 0, (
            f"{record.kind} {record.dims_text}: {bad.shape[0]} bytes differ; first at "
            f"[page, byte] {bad[0].tolist()}: kernel {got[tuple(bad[0])].item()}, "
            f"reference {want[tuple(bad[0])].item()}")


@pytest.mark.gpu
def test_prefill_window_and_sparse_on_gpu(gpu_kernels: None) -> None:
    record = RECORDS["fp8"]
    case = _case(record, [300, 2000], [17, 40], 16, 64, seed=12, device="cuda")
    _compare(case, splits=4, atol=3e-2, scale=1 / math.sqrt(192))
    _compare(case, splits=None, atol=3e-2, window=128, scale=1 / math.sqrt(192))
    gen = torch.Generator().manual_seed(13)
    topk = torch.stack([torch.randperm(300, generator=gen)[:256] for _ in range(17)]
                       + [torch.randperm(2000, generator=gen)[:256] for _ in range(40)])
    topk[3, 100:] = -1
    _compare(case, splits=3, atol=3e-2, topk=topk.int().cuda(), scale=1 / math.sqrt(192))
