"""Record descriptors: sizes from the field lists, FORMATS.md's numbers, the shared pool."""

from __future__ import annotations

import itertools

import pytest
import torch
from kernelbay_attn_flashmla.records import (
    RECORD_GRANULE,
    RECORDS,
    MLARecord,
    RecordField,
    bf16_record,
    common_page_alignment,
    fp8_e8m0_record,
    fp8_record,
    mxfp8_record,
    pool_layouts,
)

# FORMATS.md, "KV-cache records for MLA": the spec the descriptors must meet.
FORMATS_BYTES_PER_TOKEN = {"bf16": 1152, "fp8": 656, "fp8-e8m0": 584, "mxfp8": 528}
FORMATS_DIMS = {"bf16": (512, 64), "fp8": (512, 64), "fp8-e8m0": (448, 64), "mxfp8": (448, 64)}


def _torch_itemsize(dtype: str) -> int:
    # An independent source for element sizes: torch's own dtypes (torch 2.6 has no
    # float8_e8m0fnu, a one-byte type in every release that has it).
    if dtype == "float8_e8m0fnu" and not hasattr(torch, dtype):
        return 1
    return torch.empty(0, dtype=getattr(torch, dtype)).element_size()


def _size_from_fields(record: MLARecord) -> int:
    return sum(f.count * _torch_itemsize(f.dtype) for f in record.fields)


@pytest.mark.parametrize("kind", sorted(FORMATS_BYTES_PER_TOKEN))
def test_record_sizes_match_field_lists_and_formats_md(kind: str) -> None:
    record = RECORDS[kind]
    assert record.kind == kind
    assert (record.kv_lora_rank, record.rope_dim) == FORMATS_DIMS[kind]
    assert record.bytes_per_token == _size_from_fields(record)
    assert record.bytes_per_token == FORMATS_BYTES_PER_TOKEN[kind]
    assert record.bytes_per_token % RECORD_GRANULE == 0
    for field in record.fields:        # every field naturally aligned
        assert field.offset % _torch_itemsize(field.dtype) == 0, field


def test_field_order_follows_formats_md() -> None:
    def summary(kind: str) -> list[tuple[str, str, int]]:
        return [(f.name, f.dtype, f.count) for f in RECORDS[kind].fields]

    assert summary("bf16") == [("nope", "bfloat16", 512), ("rope", "bfloat16", 64)]
    assert summary("fp8") == [("nope", "float8_e4m3fn", 512), ("nope_scale", "float32", 4),
                              ("rope", "bfloat16", 64)]
    assert summary("fp8-e8m0") == [("nope", "float8_e4m3fn", 448), ("rope", "bfloat16", 64),
                                   ("nope_scale", "float8_e8m0fnu", 7), ("pad", "uint8", 1)]
    assert summary("mxfp8") == [("values", "float8_e4m3fn", 512),
                                ("scales", "float8_e8m0fnu", 16)]
    # FORMATS.md: the 528-byte record is 9.6% smaller than the 584-byte one.
    small, big = RECORDS["mxfp8"].bytes_per_token, RECORDS["fp8-e8m0"].bytes_per_token
    assert round(100 * (big - small) / big, 1) == 9.6


@pytest.mark.parametrize("rank, rope", [(64, 32), (256, 32), (128, 64), (96, 32)])
def test_factories_derive_sizes_from_dims(rank: int, rope: int) -> None:
    def granule(n: int) -> int:
        return -(-n // RECORD_GRANULE) * RECORD_GRANULE

    assert bf16_record(rank, rope).bytes_per_token == granule(2 * (rank + rope))
    assert fp8_record(rank, rope, 32).bytes_per_token == granule(rank + 4 * rank // 32 + 2 * rope)
    assert (fp8_e8m0_record(rank, rope, 32).bytes_per_token
            == granule(rank + 2 * rope + rank // 32))
    assert mxfp8_record(rank, rope).bytes_per_token == granule(rank + rope + (rank + rope) // 32)
    with pytest.raises(ValueError, match="100 values do not split into groups of 32"):
        mxfp8_record(64, 36)


@pytest.mark.parametrize("page_size", [1, 3, 16, 64])
def test_layouts_round_pages_up_to_the_alignment(page_size: int) -> None:
    for record in RECORDS.values():
        layout = record.layout(page_size)
        assert layout.bytes_per_token == record.bytes_per_token
        assert layout.record == record.kind and layout.page_size == page_size
        raw = page_size * record.bytes_per_token
        assert layout.page_bytes % layout.alignment == 0
        assert raw <= layout.page_bytes < raw + layout.alignment
    with pytest.raises(ValueError, match="page_size must be >= 1, got 0"):
        RECORDS["bf16"].layout(0)
    with pytest.raises(ValueError, match="not a positive multiple of the fp8 record alignment 4"):
        RECORDS["fp8"].layout(16, alignment=6)


def _strides(records: tuple[MLARecord, ...], page_size: int, alignment: int) -> list[int]:
    return [-(-page_size * r.bytes_per_token // alignment) * alignment for r in records]


@pytest.mark.parametrize("page_size", [1, 16, 64, 100])
def test_common_alignment_makes_strides_divide_each_other(page_size: int) -> None:
    kinds = sorted(RECORDS)
    for n in (1, 2, 3, 4):
        for combo in itertools.combinations(kinds, n):
            records = tuple(RECORDS[k] for k in combo)
            alignment = common_page_alignment(records, page_size)
            assert alignment % 256 == 0
            layouts = pool_layouts(records, page_size)
            strides = sorted(layout.page_bytes for layout in layouts)
            assert strides == sorted(_strides(records, page_size, alignment))
            assert all(b % a == 0 for a, b in itertools.pairwise(strides)), (combo, strides)
            assert all(layout.page_bytes >= page_size * layout.bytes_per_token
                       for layout in layouts)
            # No alignment (a multiple of 256 up to the largest page) gives a valid pool that
            # costs fewer bytes per page of every kind.
            top = -(-max(page_size * r.bytes_per_token for r in records) // 256) * 256
            for other in range(256, top + 1, 256):
                s = sorted(_strides(records, page_size, other))
                if all(b % a == 0 for a, b in itertools.pairwise(s)):
                    assert sum(s) >= sum(strides), (combo, other)


def test_common_alignment_examples() -> None:
    bf16, mx, e8 = RECORDS["bf16"], RECORDS["mxfp8"], RECORDS["fp8-e8m0"]
    # One kind alone keeps the base alignment.
    assert common_page_alignment([mx], 64) == 256
    # bf16 + mxfp8 at 64 tokens/page: raw pages 73728 and 33792; the mxfp8 page is padded to
    # half the bf16 page (36864 = 2^12 * 9); the smallest divisor of it above the padding
    # 36864 - 33792 = 3072 that is a multiple of 256 is 4096.
    bf16_page, mx_page = 64 * bf16.bytes_per_token, 64 * mx.bytes_per_token
    layouts = pool_layouts([bf16, mx], 64)
    assert [lay.page_bytes for lay in layouts] == [bf16_page, bf16_page // 2]
    assert layouts[0].alignment == 4096 and bf16_page // 2 > mx_page
    # fp8-e8m0 + mxfp8: one stride for both, the fp8-e8m0 page (the cheapest valid pool).
    layouts = pool_layouts([e8, mx], 64)
    assert [lay.page_bytes for lay in layouts] == [64 * e8.bytes_per_token] * 2
    with pytest.raises(ValueError, match="at least one record kind"):
        common_page_alignment([], 64)


def test_descriptor_rejects_gaps_overlaps_and_misalignment() -> None:
    with pytest.raises(ValueError, match="starts at 6, the previous field ends at 4"):
        MLARecord("bf16", 2, 1, (RecordField("nope", 0, "bfloat16", 2),
                                 RecordField("rope", 6, "bfloat16", 1)))
    with pytest.raises(ValueError, match="offset 3 is not a multiple of its element size 4"):
        RecordField("nope_scale", 3, "float32", 1)
    with pytest.raises(ValueError, match="dtype 'int4' is not one of"):
        RecordField("x", 0, "int4", 1)
    with pytest.raises(KeyError, match="no field 'scales'"):
        RECORDS["bf16"].field("scales")
    assert "656 B/token" in RECORDS["fp8"].describe()


def test_readme_draws_the_records_as_the_descriptors_do() -> None:
    import pathlib

    from kernelbay_attn_flashmla.records import layout_diagram

    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")
    drawn = "\n\n".join(layout_diagram(r) for r in RECORDS.values())
    assert f"```text\n{drawn}\n```" in readme


def test_records_for_other_dims_derive_their_groups() -> None:
    from kernelbay_attn_flashmla.records import record_for_dims

    for kind in RECORDS:
        default = RECORDS[kind]
        assert record_for_dims(kind, default.kv_lora_rank, default.rope_dim) is default
    demo = {k: record_for_dims(k, 64, 16) for k in RECORDS}
    assert {k: r.group_size for k, r in demo.items()} == {
        "bf16": None, "fp8": 64, "fp8-e8m0": 64, "mxfp8": 16}
    for r in demo.values():
        assert r.latent_dim == 80 and r.bytes_per_token % 8 == 0
    with pytest.raises(ValueError, match=r"mxfp8 records at 60\+2: 62 scaled values"):
        record_for_dims("mxfp8", 60, 2)
    with pytest.raises(ValueError, match="no MLA record kind 'fp4'"):
        record_for_dims("fp4", 64, 16)
