"""MLA KV-cache record descriptors: one frozen object per record kind (torch-free).

A record holds one token's latent vector, ``kv_lora_rank`` "nope" values followed by
``rope_dim`` RoPE values, in one of four encodings (FORMATS.md, "KV-cache records for MLA"):

    kind       dims      fields (in byte order)
    bf16       512+64    nope bf16 x512 | rope bf16 x64
    fp8        512+64    nope E4M3 x512 | nope_scale fp32 x4 (one per 128) | rope bf16 x64
    fp8-e8m0   448+64    nope E4M3 x448 | rope bf16 x64 | nope_scale E8M0 x7 (one per 64) | pad
    mxfp8      448+64    values E4M3 x512 (nope then rope) | scales E8M0 x16 (one per 32)

Fields are laid out back to back from offset 0; a record is padded with an explicit ``pad``
field to a multiple of ``RECORD_GRANULE`` bytes, so consecutive records keep every field
naturally aligned. Bytes per token, page bytes and alignment are derived from the fields and
never written as numbers anywhere else.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import final

from kernelbay.layers import KVCacheLayout

__all__ = [
    "DEFAULT_PAGE_ALIGNMENT",
    "DTYPE_SIZES",
    "FACTORIES",
    "MIN_GROUP",
    "RECORDS",
    "RECORD_GRANULE",
    "MLARecord",
    "RecordField",
    "bf16_record",
    "common_page_alignment",
    "fp8_e8m0_record",
    "fp8_record",
    "layout_diagram",
    "mxfp8_record",
    "pool_layouts",
    "record_for_dims",
]

#: Bytes per element of each field dtype (names as torch spells them).
DTYPE_SIZES: dict[str, int] = {
    "bfloat16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
    "float8_e8m0fnu": 1,
    "uint8": 1,
}

#: Records are padded to a multiple of this many bytes: 8 keeps a following record's fp32 and
#: bf16 fields aligned and lets kernels move records in 64-bit units.
RECORD_GRANULE = 8

#: Page stride alignment used when a record kind has a pool of its own (the core's default).
DEFAULT_PAGE_ALIGNMENT = 256


@final
@dataclass(frozen=True)
class RecordField:
    """One field of a record: ``count`` elements of ``dtype`` starting at byte ``offset``."""

    name: str
    offset: int
    dtype: str
    count: int

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"field {self.name!r}: dtype {self.dtype!r} is not one of "
                             f"{sorted(DTYPE_SIZES)}")
        if self.count < 1 or self.offset < 0:
            raise ValueError(f"field {self.name!r}: needs count >= 1 and offset >= 0, got "
                             f"count={self.count}, offset={self.offset}")
        if self.offset % self.itemsize:
            raise ValueError(f"field {self.name!r}: offset {self.offset} is not a multiple of "
                             f"its element size {self.itemsize} ({self.dtype})")

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return DTYPE_SIZES[self.dtype]

    @property
    def nbytes(self) -> int:
        """Bytes the field occupies."""
        return self.count * self.itemsize

    @property
    def end(self) -> int:
        """First byte after the field."""
        return self.offset + self.nbytes


@final
@dataclass(frozen=True)
class MLARecord:
    """One MLA KV-cache record kind: its latent dims, its fields, and what derives from them.

    ``kind`` is the ``kv_cache`` name a request uses (``"bf16"``, ``"fp8"``, ``"fp8-e8m0"``,
    ``"mxfp8"``) and selects the codec; ``group_size`` is the number of elements sharing one
    scale (``None`` for bf16). The fields must tile ``[0, bytes_per_token)`` exactly, in
    order, without gaps (padding is a field of its own).
    """

    kind: str
    kv_lora_rank: int
    rope_dim: int
    fields: tuple[RecordField, ...]
    group_size: int | None = None

    def __post_init__(self) -> None:
        names = [f.name for f in self.fields]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.kind}: field names repeat: {names}")
        position = 0
        for f in self.fields:
            if f.offset != position:
                raise ValueError(f"{self.kind}: field {f.name!r} starts at {f.offset}, the "
                                 f"previous field ends at {position} (fields must tile the "
                                 "record without gaps or overlaps)")
            position = f.end
        if position == 0:
            raise ValueError(f"{self.kind}: a record needs at least one field")

    @property
    def latent_dim(self) -> int:
        """Values per token: ``kv_lora_rank + rope_dim``."""
        return self.kv_lora_rank + self.rope_dim

    @property
    def bytes_per_token(self) -> int:
        """Record size, the end of the last field."""
        return self.fields[-1].end

    @property
    def alignment(self) -> int:
        """Largest element size of any field: the alignment a record's start needs."""
        return max(f.itemsize for f in self.fields)

    @property
    def dims_text(self) -> str:
        """The latent dims as ``"512+64"``."""
        return f"{self.kv_lora_rank}+{self.rope_dim}"

    def field(self, name: str) -> RecordField:
        """The field called ``name``; ``KeyError`` lists the valid names."""
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(f"{self.kind} records have no field {name!r}; fields: "
                       f"{[f.name for f in self.fields]}")

    def page_bytes(self, page_size: int, alignment: int = DEFAULT_PAGE_ALIGNMENT) -> int:
        """Page stride: ``page_size`` records rounded up to ``alignment`` bytes."""
        return self.layout(page_size, alignment).page_bytes

    def layout(self, page_size: int, alignment: int = DEFAULT_PAGE_ALIGNMENT) -> KVCacheLayout:
        """The core's ``KVCacheLayout`` for pages of ``page_size`` tokens."""
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if alignment < 1 or alignment % self.alignment:
            raise ValueError(f"page alignment {alignment} is not a positive multiple of the "
                             f"{self.kind} record alignment {self.alignment}")
        return KVCacheLayout(self.bytes_per_token, page_size, alignment, record=self.kind)

    def describe(self) -> str:
        """One line, e.g. ``fp8 512+64: 656 B/token (nope float8_e4m3fn x512 @0, ...)``."""
        parts = ", ".join(f"{f.name} {f.dtype} x{f.count} @{f.offset}" for f in self.fields)
        return f"{self.kind} {self.dims_text}: {self.bytes_per_token} B/token ({parts})"


def _pack(*specs: tuple[str, str, int]) -> tuple[RecordField, ...]:
    """Lay ``(name, dtype, count)`` fields back to back, then pad to ``RECORD_GRANULE``."""
    fields: list[RecordField] = []
    offset = 0
    for name, dtype, count in specs:
        fields.append(RecordField(name, offset, dtype, count))
        offset = fields[-1].end
    if offset % RECORD_GRANULE:
        fields.append(RecordField("pad", offset, "uint8", RECORD_GRANULE - offset % RECORD_GRANULE))
    return tuple(fields)


def _groups(kind: str, values: int, group: int) -> int:
    if group < 1 or values % group:
        raise ValueError(f"{kind}: {values} values do not split into groups of {group}")
    return values // group


def bf16_record(kv_lora_rank: int = 512, rope_dim: int = 64) -> MLARecord:
    """bf16 record: the latent as is (DeepSeek-V3 dims by default)."""
    return MLARecord("bf16", kv_lora_rank, rope_dim,
                     _pack(("nope", "bfloat16", kv_lora_rank), ("rope", "bfloat16", rope_dim)))


def fp8_record(kv_lora_rank: int = 512, rope_dim: int = 64, group: int = 128) -> MLARecord:
    """FP8 record with fp32 scales (DeepSeek-V3.2 style): E4M3 nope with one fp32 multiplier
    per ``group`` values (amax / 448), bf16 rope."""
    return MLARecord("fp8", kv_lora_rank, rope_dim,
                     _pack(("nope", "float8_e4m3fn", kv_lora_rank),
                           ("nope_scale", "float32", _groups("fp8", kv_lora_rank, group)),
                           ("rope", "bfloat16", rope_dim)),
                     group)


def fp8_e8m0_record(kv_lora_rank: int = 448, rope_dim: int = 64, group: int = 64) -> MLARecord:
    """FP8 record with E8M0 scales (DeepSeek-V4 style): E4M3 nope with one power-of-two scale
    per ``group`` values (MX rceil rule), bf16 rope, scales last, padded."""
    return MLARecord("fp8-e8m0", kv_lora_rank, rope_dim,
                     _pack(("nope", "float8_e4m3fn", kv_lora_rank),
                           ("rope", "bfloat16", rope_dim),
                           ("nope_scale", "float8_e8m0fnu",
                            _groups("fp8-e8m0", kv_lora_rank, group))),
                     group)


def mxfp8_record(kv_lora_rank: int = 448, rope_dim: int = 64, block: int = 32) -> MLARecord:
    """MXFP8 record: nope and rope together as OCP MXFP8 (E4M3, one E8M0 scale per
    ``block`` values, rceil rule)."""
    values = kv_lora_rank + rope_dim
    return MLARecord("mxfp8", kv_lora_rank, rope_dim,
                     _pack(("values", "float8_e4m3fn", values),
                           ("scales", "float8_e8m0fnu", _groups("mxfp8", values, block))),
                     block)


#: The record kinds the backends store, keyed by ``AttentionRequest.kv_cache`` name, at the
#: dims FORMATS.md gives them.
RECORDS: dict[str, MLARecord] = {r.kind: r for r in (bf16_record(), fp8_record(),
                                                      fp8_e8m0_record(), mxfp8_record())}


def _stride(raw: int, alignment: int) -> int:
    return -(-raw // alignment) * alignment


def _chain(strides: Sequence[int]) -> bool:
    ordered = sorted(strides)
    return all(b % a == 0 for a, b in itertools.pairwise(ordered))


def common_page_alignment(records: Sequence[MLARecord], page_size: int,
                          base_alignment: int = DEFAULT_PAGE_ALIGNMENT) -> int:
    """Page alignment for record kinds sharing one page pool, so their strides divide each other.

    Every kind's page stride is ``page_size * bytes_per_token`` rounded up to the returned
    alignment A. A is a multiple of ``base_alignment`` (and of every record's alignment),
    and is chosen so the strides, sorted, each divide the next (a pool page of the largest
    stride splits exactly into pages of each smaller one). Among such A it minimises the sum
    of the strides (the bytes one page of every kind costs), then A itself. A always exists:
    at A >= the largest raw page, all strides are equal.
    """
    if not records:
        raise ValueError("common_page_alignment needs at least one record kind, got none")
    if page_size < 1 or base_alignment < 1:
        raise ValueError(f"needs page_size >= 1 and base_alignment >= 1, got {page_size} and "
                         f"{base_alignment}")
    unit = math.lcm(base_alignment, *(r.alignment for r in records))
    raws = [page_size * r.bytes_per_token for r in records]
    best: tuple[int, int] | None = None
    for alignment in range(unit, _stride(max(raws), unit) + 1, unit):
        strides = [_stride(raw, alignment) for raw in raws]
        if _chain(strides) and (best is None or sum(strides) < best[0]):
            best = (sum(strides), alignment)
    assert best is not None  # the last candidate always forms a chain
    return best[1]


def pool_layouts(records: Sequence[MLARecord], page_size: int,
                 base_alignment: int = DEFAULT_PAGE_ALIGNMENT) -> tuple[KVCacheLayout, ...]:
    """Each record's ``KVCacheLayout`` at the common alignment of a shared page pool."""
    alignment = common_page_alignment(records, page_size, base_alignment)
    return tuple(r.layout(page_size, alignment) for r in records)


#: Each kind's factory, keyed by ``kv_cache`` name (for records at other latent dims).
FACTORIES = {"bf16": bf16_record, "fp8": fp8_record, "fp8-e8m0": fp8_e8m0_record,
             "mxfp8": mxfp8_record}


def record_for_dims(kind: str, kv_lora_rank: int, rope_dim: int) -> MLARecord:
    """The ``kind`` record for a model's latent dims.

    At the dims FORMATS.md gives a kind, this is ``RECORDS[kind]``. At other dims the same
    fields are laid out for ``kv_lora_rank + rope_dim``; a scale group is the kind's default
    group (fp8 128, fp8-e8m0 64, mxfp8 32) when it divides the scaled values, else the
    largest common divisor of the two (e.g. 64+16 latents: fp8 and fp8-e8m0 groups of 64,
    mxfp8 blocks of 16), at least 8. ``ValueError`` names the kind and dims otherwise.
    """
    if kind not in FACTORIES:
        raise ValueError(f"no MLA record kind {kind!r}; kinds: {sorted(FACTORIES)}")
    if kv_lora_rank < 1 or rope_dim < 1:
        raise ValueError(f"{kind} records need kv_lora_rank >= 1 and rope_dim >= 1, got "
                         f"{kv_lora_rank}+{rope_dim}")
    default = RECORDS[kind]
    if (default.kv_lora_rank, default.rope_dim) == (kv_lora_rank, rope_dim):
        return default
    if kind == "bf16":
        return bf16_record(kv_lora_rank, rope_dim)
    scaled = kv_lora_rank + rope_dim if kind == "mxfp8" else kv_lora_rank
    assert default.group_size is not None
    group = math.gcd(scaled, default.group_size)
    if group < MIN_GROUP:
        raise ValueError(f"{kind} records at {kv_lora_rank}+{rope_dim}: {scaled} scaled values "
                         f"share no group of {MIN_GROUP} or more with the default group "
                         f"{default.group_size} (largest common divisor {group})")
    grouped = {"fp8": fp8_record, "fp8-e8m0": fp8_e8m0_record, "mxfp8": mxfp8_record}
    return grouped[kind](kv_lora_rank, rope_dim, group)


#: Smallest scale group ``record_for_dims`` derives (smaller groups cost more scale bytes
#: than they save).
MIN_GROUP = 8


def layout_diagram(record: MLARecord) -> str:
    """The record drawn byte by byte: a header, then one line per field with its byte range,
    e.g. ``bytes    0- 447  nope        float8_e4m3fn x448 (1 B each)``."""
    lines = [f"{record.kind} {record.dims_text}: {record.bytes_per_token} bytes per token"]
    for f in record.fields:
        lines.append(f"  bytes {f.offset:4d}-{f.end - 1:4d}  {f.name:<10}  {f.dtype} x{f.count} "
                     f"({f.itemsize} B each)")
    return "\n".join(lines)
