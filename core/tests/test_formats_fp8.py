"""FP8 E4M3 per-tensor and per-block (ragged tiles) against numpy + ml_dtypes."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from kernelbay.formats import (
    dequantize_fp8_per_block,
    dequantize_fp8_per_tensor,
    e4m3_bits,
    quantize_fp8_per_block,
    quantize_fp8_per_tensor,
)

F8 = ml_dtypes.float8_e4m3fn


def ml_e4m3(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.clip(x, -448, 448).astype(F8).view(np.uint8).copy())


def random_matrix(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * torch.exp2(
        torch.randint(-12, 12, (*shape[:-1], 1), generator=g).float()
    )


def test_per_tensor_matches_ml_dtypes() -> None:
    x = random_matrix((64, 96), seed=15)
    q, scale = quantize_fp8_per_tensor(x)
    xn = x.numpy()
    want_scale = np.float32(np.abs(xn).max()) / np.float32(448)
    assert scale.shape == () and scale.item() == want_scale
    assert q.dtype == torch.float8_e4m3fn
    assert torch.equal(e4m3_bits(q), ml_e4m3(xn / want_scale))
    assert e4m3_bits(q).view(-1)[int(x.abs().argmax())].item() & 0x7F == 0x7E  # amax -> 448
    deq = dequantize_fp8_per_tensor(q, scale)
    assert ((deq - x).abs() <= x.abs() / 16 + scale * 2.0**-10).all()


def test_per_tensor_zero_and_bf16() -> None:
    q, scale = quantize_fp8_per_tensor(torch.zeros(4, 4))
    assert scale.item() == 1.0 and q.float().eq(0).all()
    x = random_matrix((8, 32), seed=16).bfloat16()
    q, scale = quantize_fp8_per_tensor(x)
    assert torch.equal(e4m3_bits(q), ml_e4m3(x.float().numpy() / scale.numpy()))
    assert dequantize_fp8_per_tensor(q, scale, torch.bfloat16).dtype == torch.bfloat16


def independent_per_block(x: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, ...]:
    """Loop over tiles, each with the amax of the elements it has."""
    xn = x.numpy()
    n, k = xn.shape
    scales = np.zeros((-(-n // bn), -(-k // bk)), dtype=np.float32)
    codes = torch.zeros(n, k, dtype=torch.uint8)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            tile = xn[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk]
            amax = np.float32(np.abs(tile).max())
            s = amax / np.float32(448) if amax > 0 else np.float32(1)
            scales[i, j] = s
            codes[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = ml_e4m3(tile / s)
    return codes, torch.from_numpy(scales)


@pytest.mark.parametrize(
    ("shape", "block"),
    [
        ((256, 384), (128, 128)),
        ((300, 200), (128, 128)),
        ((70, 45), (32, 16)),
        ((5, 7), (128, 128)),
    ],
)
def test_per_block_matches_independent_tiles(
    shape: tuple[int, int], block: tuple[int, int]
) -> None:
    x = random_matrix(shape, seed=17)
    q, scales = quantize_fp8_per_block(x, block)
    codes, want_scales = independent_per_block(x, *block)
    assert scales.shape == (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    assert torch.equal(scales, want_scales)
    assert torch.equal(e4m3_bits(q), codes)
    deq = dequantize_fp8_per_block(q, scales, block)
    unit = scales.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    assert ((deq - x).abs() <= x.abs() / 16 + unit[: shape[0], : shape[1]] * 2.0**-10).all()


def test_partial_tile_gets_its_own_amax() -> None:
    x = torch.full((130, 130), 100.0)
    x[128:, :] = 0.5  # the partial row of tiles
    x[:, 128:] = 2.0  # the partial column of tiles
    x[0, 0] = 448.0
    _, scales = quantize_fp8_per_block(x)
    assert torch.equal(scales, torch.tensor([[448.0, 2.0], [0.5, 2.0]]) / 448)
    x[:128, :128] = 0.0
    _, scales = quantize_fp8_per_block(x)
    assert scales[0, 0].item() == 1.0  # a zero tile


def test_per_block_batch_dims_and_errors() -> None:
    x = random_matrix((3, 40, 72), seed=18)  # MoE-style [E, N, K]
    q, scales = quantize_fp8_per_block(x, (32, 32))
    assert q.shape == x.shape and scales.shape == (3, 2, 3)
    q1, s1 = quantize_fp8_per_block(x[1], (32, 32))
    assert torch.equal(e4m3_bits(q[1]), e4m3_bits(q1)) and torch.equal(scales[1], s1)
    with pytest.raises(ValueError, match="want"):
        dequantize_fp8_per_block(q, scales[:, :1], (32, 32))
    with pytest.raises(ValueError, match=r"\[\.\.\., N, K\]"):
        quantize_fp8_per_block(torch.randn(8))
