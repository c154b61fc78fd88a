"""``shard_block_scales``: split with the weight, replicate below one scale block."""

from __future__ import annotations

import pytest
import torch
from kernelbay.formats import dequantize_fp8_per_block, quantize_fp8_per_block
from kernelbay_quant_nvfp4.tp import block_scale_sharding, shard_block_scales

TP_SIZES = (1, 2, 4, 8)


@pytest.mark.parametrize("tp", TP_SIZES)
def test_nvfp4_scales_split_along_k(tp: int) -> None:
    # NVFP4 row parallel: [N, K/16] scales, K = 512, block 16 along K: 512/8 = 64 >= 16.
    scales = torch.randn(24, 32, generator=torch.Generator().manual_seed(tp))
    parts = [shard_block_scales(scales, 1, r, tp, 16) for r in range(tp)]
    assert all(p.shape == (24, 32 // tp) for p in parts)
    assert torch.equal(torch.cat(parts, dim=1), scales)
    # Column parallel: one scale row per weight row (block 1 along N) always splits.
    rows = [shard_block_scales(scales, 0, r, tp, 1) for r in range(tp)]
    assert torch.equal(torch.cat(rows, dim=0), scales)
    assert block_scale_sharding(512, tp, 16) == "split"


@pytest.mark.parametrize(("tp", "expect"), [(1, "split"), (2, "split"), (4, "replicate"),
                                            (8, "replicate")])
def test_fp8_block_scales_replicate_below_one_block(tp: int, expect: str) -> None:
    """A 256-row projection in 128x128 FP8 tiles: 64 rows per rank under TP 4 is less than
    one tile, so every rank keeps every scale and indexes it by its global row."""
    n, k = 256, 384
    gen = torch.Generator().manual_seed(tp)
    q, scales = quantize_fp8_per_block(torch.randn(n, k, generator=gen))
    whole = dequantize_fp8_per_block(q, scales)
    assert block_scale_sharding(n, tp, 128) == expect
    shard = n // tp
    for r in range(tp):
        part = shard_block_scales(scales, 0, r, tp, 128, size=n)
        if expect == "split":
            assert part.shape == (shard // 128, 3)
            rows = dequantize_fp8_per_block(q[r * shard:(r + 1) * shard], part)
        else:
            assert torch.equal(part, scales)
            # Each of the rank's rows finds its scale at its global row // 128.
            global_rows = torch.arange(r * shard, (r + 1) * shard)
            row_scales = part[global_rows // 128].repeat_interleave(128, dim=1)[:, :k]
            rows = q.float()[global_rows] * row_scales  # (torch 2.6 cannot index fp8 on CPU)
        assert torch.equal(rows, whole[r * shard:(r + 1) * shard])


@pytest.mark.parametrize("tp", TP_SIZES)
def test_small_gate_projection_replicates(tp: int) -> None:
    # A 32-wide K (two NVFP4 blocks) under TP 4/8 leaves 8 or 4 columns per rank.
    scales = torch.arange(2 * 6, dtype=torch.float32).reshape(6, 2)
    parts = [shard_block_scales(scales, 1, r, tp, 16, size=32) for r in range(tp)]
    if tp <= 2:
        assert torch.equal(torch.cat(parts, dim=1), scales)
    else:
        assert all(torch.equal(p, scales) for p in parts)


def test_misaligned_shards_replicate_and_bad_arguments_fail() -> None:
    scales = torch.ones(3, 4)  # N = 384 in 128-row tiles
    assert block_scale_sharding(384, 2, 128) == "replicate"  # 192 rows straddle a tile
    assert torch.equal(shard_block_scales(scales, 0, 1, 2, 128, size=384), scales)
    assert shard_block_scales(scales, -2, 0, 3, 128).shape == (1, 4)
    with pytest.raises(ValueError, match="not divisible by tensor-parallel size 4"):
        shard_block_scales(scales, 0, 0, 4, 128, size=382)
    with pytest.raises(ValueError, match=r"tp_rank must be in \[0, 1\], got 2"):
        shard_block_scales(scales, 0, 2, 2, 128)
    with pytest.raises(ValueError, match="need 2"):
        shard_block_scales(scales, 0, 0, 2, 128, size=256)
    with pytest.raises(ValueError, match="dim 2 is out of range"):
        shard_block_scales(scales, 2, 0, 2, 128)
    with pytest.raises(ValueError, match="block must be >= 1"):
        block_scale_sharding(256, 2, 0)
