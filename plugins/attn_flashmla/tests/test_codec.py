"""Record codec: bytes in their fields, bit-exact with kernelbay.formats, and within each
format's per-element error bound (derived in ``_bounds.py``)."""

from __future__ import annotations

import pytest
import torch
from _bounds import element_bound
from kernelbay.formats import quantize_fp8_per_block, quantize_mx
from kernelbay_attn_flashmla.codec import decode_records, encode_records, read_field
from kernelbay_attn_flashmla.records import RECORDS, MLARecord

KINDS = sorted(RECORDS)


def _latents(record: MLARecord, seed: int) -> torch.Tensor:
    """Random latents with awkward rows: zeros, huge and tiny magnitudes, one-hot spikes."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(9, record.latent_dim, generator=gen)
    x[1] = 0.0                                               # an all-zero record
    x[2] *= 1e4
    x[3] *= 1e-20
    x[4] = torch.randn(record.latent_dim, generator=gen).sign() * 448.0
    x[5, :] = 1e-3
    x[5, 7] = 3e3                                            # one spike per record
    x[6, : record.kv_lora_rank // 2] = 0.0                   # zero groups beside full ones
    x[7] = torch.randn(record.latent_dim, generator=gen) * torch.logspace(
        -8, 8, record.latent_dim)                           # every magnitude at once
    return x


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_within_the_format_bound(kind: str) -> None:
    record = RECORDS[kind]
    x = _latents(record, seed=len(kind))
    records = encode_records(record, x)
    assert records.shape == (9, record.bytes_per_token) and records.dtype == torch.uint8
    y = decode_records(record, records)
    assert y.shape == x.shape and torch.isfinite(y).all()
    err = (y - x).abs()
    bound = element_bound(record, x)
    assert bool((err <= bound).all()), (kind, (err - bound).max())
    assert torch.equal(y[1], torch.zeros(record.latent_dim))
    # Leading dimensions are free: a [2, 3, dim] batch encodes like its rows.
    batch = x[:6].reshape(2, 3, -1)
    assert torch.equal(encode_records(record, batch).reshape(6, -1), records[:6])


def test_bf16_records_are_exact_bf16() -> None:
    record = RECORDS["bf16"]
    x = _latents(record, 1)
    torch.testing.assert_close(decode_records(record, encode_records(record, x)),
                               x.bfloat16().float(), rtol=0, atol=0)


def test_fp8_record_fields_are_the_shared_reference() -> None:
    record = RECORDS["fp8"]
    x = _latents(record, 2)
    records = encode_records(record, x)
    q, scales = quantize_fp8_per_block(x[:, None, :512], (1, 128))
    assert torch.equal(read_field(records, record.field("nope")).view(torch.uint8),
                       q[:, 0].view(torch.uint8))
    assert torch.equal(read_field(records, record.field("nope_scale")), scales[:, 0])
    assert torch.equal(read_field(records, record.field("rope")), x[:, 512:].bfloat16())


def test_fp8_scales_sit_at_their_offsets() -> None:
    # Group g of the nope part has amax 448 * (g + 1), so its fp32 scale is exactly g + 1,
    # stored at byte 512 + 4 g (after the 512 E4M3 nope bytes).
    record = RECORDS["fp8"]
    x = torch.zeros(1, 576)
    for g in range(4):
        x[0, 128 * g] = 448.0 * (g + 1)
    x[0, 512:] = torch.arange(64) - 32.0
    raw = encode_records(record, x)[0]
    assert raw[512:528].view(torch.float32).tolist() == [1.0, 2.0, 3.0, 4.0]
    assert raw[528:656].view(torch.bfloat16).tolist() == (torch.arange(64) - 32.0).tolist()
    assert raw[0].item() == 0x7E                      # 448 / 1 = 448 = E4M3 0x7E


@pytest.mark.parametrize("kind, field, group", [("fp8-e8m0", "nope", 64),
                                                ("mxfp8", "values", 32)])
def test_e8m0_records_are_the_shared_mx_reference(kind: str, field: str, group: int) -> None:
    record = RECORDS[kind]
    x = _latents(record, 3)
    records = encode_records(record, x)
    source = x if kind == "mxfp8" else x[:, :448]
    q, scales = quantize_mx(source, "e4m3", "rceil", group)
    scale_field = "scales" if kind == "mxfp8" else "nope_scale"
    assert torch.equal(read_field(records, record.field(field)).view(torch.uint8),
                       q.view(torch.uint8))
    assert torch.equal(read_field(records, record.field(scale_field)), scales)


def test_e8m0_scales_sit_at_their_offsets() -> None:
    # fp8-e8m0: group g (64 values) with amax 448 * 2^(g-3) has scale 2^(g-3): byte 124 + g,
    # stored after the nope (448 B) and the bf16 rope (128 B), then one zero pad byte.
    record = RECORDS["fp8-e8m0"]
    x = torch.zeros(1, 512)
    for g in range(7):
        x[0, 64 * g + 5] = 448.0 * 2.0 ** (g - 3)
    raw = encode_records(record, x)[0]
    assert raw[576:583].tolist() == [124 + g for g in range(7)]
    assert raw[583].item() == 0
    # mxfp8: 16 blocks of 32 over nope and rope together, scales after the 512 values.
    record = RECORDS["mxfp8"]
    x = torch.zeros(1, 512)
    for g in range(16):
        x[0, 32 * g] = 448.0 * 2.0 ** (g - 8)
    raw = encode_records(record, x)[0]
    assert raw[512:528].tolist() == [119 + g for g in range(16)]


def test_codec_rejects_wrong_shapes() -> None:
    with pytest.raises(ValueError, match=r"fp8-e8m0 records hold 448\+64 latent dims"):
        encode_records(RECORDS["fp8-e8m0"], torch.zeros(2, 576))
    with pytest.raises(ValueError, match=r"uint8 \[..., 528\]"):
        decode_records(RECORDS["mxfp8"], torch.zeros(2, 584, dtype=torch.uint8))
