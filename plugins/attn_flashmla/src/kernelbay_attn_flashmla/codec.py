"""Encode latent vectors into MLA records and decode them back, in torch (the reference).

A latent is ``[..., kv_lora_rank + rope_dim]``: the nope part, then the rope part. Records
are uint8 ``[..., bytes_per_token]`` laid out as the record's fields say. The number-format
math is ``kernelbay.formats`` (the one shared reference):

    bf16      nope, rope -> bfloat16 (round to nearest even)
    fp8       nope: quantize_fp8_per_block with (1, group) tiles: scale = amax / 448 (fp32,
              1.0 for an all-zero group), E4M3 = clamp(x / scale) rounded; rope -> bfloat16
    fp8-e8m0  nope: quantize_mx(e4m3, rule "rceil", block = group): scale = 2^ceil(log2(
              amax / 448)) as an E8M0 byte; rope -> bfloat16
    mxfp8     nope and rope together: quantize_mx(e4m3, "rceil", block 32)

Decoding multiplies each element by its group's scale in float32.
"""

from __future__ import annotations

import torch
from kernelbay.formats import (
    dequantize_fp8_per_block,
    dequantize_mx,
    quantize_fp8_per_block,
    quantize_mx,
)
from torch import Tensor

from kernelbay_attn_flashmla.records import MLARecord, RecordField

__all__ = ["decode_records", "encode_records", "read_field", "write_field"]

# How a field's bytes are viewed in torch. E8M0 scales and padding stay raw bytes: the
# shared reference reads E8M0 as uint8.
_VIEW = {
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e8m0fnu": torch.uint8,
    "uint8": torch.uint8,
}


def write_field(records: Tensor, field: RecordField, values: Tensor) -> None:
    """Store ``values [..., field.count]`` (already of the field's dtype) into ``records``."""
    want = _VIEW[field.dtype]
    if values.dtype != want or values.shape[-1] != field.count:
        raise ValueError(f"field {field.name!r} wants [..., {field.count}] {want}, got "
                         f"{tuple(values.shape)} {values.dtype}")
    raw = values.contiguous().view(torch.uint8)
    records[..., field.offset:field.end] = raw.reshape(*values.shape[:-1], field.nbytes)


def read_field(records: Tensor, field: RecordField) -> Tensor:
    """The field's elements ``[..., field.count]`` viewed as its dtype (E8M0 as uint8)."""
    return records[..., field.offset:field.end].contiguous().view(_VIEW[field.dtype])


def _check(record: MLARecord, latent: Tensor) -> None:
    if latent.shape[-1] != record.latent_dim:
        raise ValueError(f"{record.kind} records hold {record.dims_text} latent dims, got a "
                         f"latent of shape {tuple(latent.shape)}")


def encode_records(record: MLARecord, latent: Tensor) -> Tensor:
    """Records uint8 ``[..., bytes_per_token]`` of a latent ``[..., kv_lora_rank + rope_dim]``."""
    _check(record, latent)
    lead = latent.shape[:-1]
    out = torch.zeros(*lead, record.bytes_per_token, dtype=torch.uint8, device=latent.device)
    x = latent.float()
    nope, rope = x[..., :record.kv_lora_rank], x[..., record.kv_lora_rank:]
    if record.kind == "bf16":
        write_field(out, record.field("nope"), nope.to(torch.bfloat16))
        write_field(out, record.field("rope"), rope.to(torch.bfloat16))
    elif record.kind == "fp8":
        assert record.group_size is not None
        q, scales = quantize_fp8_per_block(nope.unsqueeze(-2), (1, record.group_size))
        write_field(out, record.field("nope"), q.squeeze(-2))
        write_field(out, record.field("nope_scale"), scales.squeeze(-2))
        write_field(out, record.field("rope"), rope.to(torch.bfloat16))
    elif record.kind == "fp8-e8m0":
        assert record.group_size is not None
        q, scales = quantize_mx(nope, "e4m3", "rceil", record.group_size)
        write_field(out, record.field("nope"), q)
        write_field(out, record.field("nope_scale"), scales)
        write_field(out, record.field("rope"), rope.to(torch.bfloat16))
    elif record.kind == "mxfp8":
        assert record.group_size is not None
        q, scales = quantize_mx(x, "e4m3", "rceil", record.group_size)
        write_field(out, record.field("values"), q)
        write_field(out, record.field("scales"), scales)
    else:
        raise ValueError(f"no codec for record kind {record.kind!r}; known: "
                         "['bf16', 'fp8', 'fp8-e8m0', 'mxfp8']")
    return out


def decode_records(record: MLARecord, records: Tensor) -> Tensor:
    """Float32 latents ``[..., kv_lora_rank + rope_dim]`` of records ``[..., bytes_per_token]``."""
    if records.dtype != torch.uint8 or records.shape[-1] != record.bytes_per_token:
        raise ValueError(f"{record.kind} records are uint8 [..., {record.bytes_per_token}], got "
                         f"{tuple(records.shape)} {records.dtype}")
    if record.kind == "bf16":
        nope = read_field(records, record.field("nope")).float()
        rope = read_field(records, record.field("rope")).float()
    elif record.kind == "fp8":
        assert record.group_size is not None
        q = read_field(records, record.field("nope")).unsqueeze(-2)
        scales = read_field(records, record.field("nope_scale")).unsqueeze(-2)
        nope = dequantize_fp8_per_block(q, scales, (1, record.group_size)).squeeze(-2)
        rope = read_field(records, record.field("rope")).float()
    elif record.kind == "fp8-e8m0":
        assert record.group_size is not None
        nope = dequantize_mx(read_field(records, record.field("nope")),
                             read_field(records, record.field("nope_scale")), "e4m3",
                             record.group_size)
        rope = read_field(records, record.field("rope")).float()
    elif record.kind == "mxfp8":
        assert record.group_size is not None
        return dequantize_mx(read_field(records, record.field("values")),
                             read_field(records, record.field("scales")), "e4m3",
                             record.group_size)
    else:
        raise ValueError(f"no codec for record kind {record.kind!r}; known: "
                         "['bf16', 'fp8', 'fp8-e8m0', 'mxfp8']")
    return torch.cat([nope, rope], dim=-1)
