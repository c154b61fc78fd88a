"""NVFP4 against an independent numpy + ml_dtypes computation (ModelOpt's order of operations)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from kernelbay.formats import (
    compressed_tensors_global_scale,
    decode_e2m1,
    dequantize_nvfp4,
    e4m3_bits,
    nvfp4_global_scale,
    quantize_nvfp4,
    unpack_e2m1,
)

F4, F8 = ml_dtypes.float4_e2m1fn, ml_dtypes.float8_e4m3fn


def independent_nvfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(codes [N, K], block scale bytes [N, K/16], global) in float32 numpy, as ModelOpt does."""
    x = w.float().numpy()
    g = np.float32(np.abs(x).max()) / np.float32(6 * 448)
    xb = x.reshape(x.shape[0], -1, 16)
    s = np.abs(xb).max(-1) / (np.float32(6) * g)
    s[s == 0] = 1.0
    s8 = np.clip(s, -448, 448).astype(F8)
    scale = s8.astype(np.float32) * g
    with np.errstate(divide="ignore", invalid="ignore"):  # zero scales: ignored by the tests
        codes = (xb / scale[..., None]).astype(F4).view(np.uint8).reshape(x.shape)
    return torch.from_numpy(codes.copy()), torch.from_numpy(s8.view(np.uint8).copy()), float(g)


def random_rows(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * torch.exp2(torch.randint(-4, 4, (n, 1), generator=g))


def test_matches_independent_math() -> None:
    w = random_rows(64, 256, seed=9)
    w[3, 16:32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2)  # E2M1 ties
    packed, scales, g = quantize_nvfp4(w)
    codes, want_scales, want_g = independent_nvfp4(w)
    assert packed.shape == (64, 128) and scales.shape == (64, 16) and g.shape == ()
    assert g.dtype == torch.float32 and g.item() == want_g
    assert torch.equal(e4m3_bits(scales), want_scales)
    assert torch.equal(unpack_e2m1(packed), codes)


def test_bf16_input_and_batch_dims() -> None:
    w = random_rows(24, 64, seed=10).bfloat16().reshape(2, 12, 64)  # MoE-style [E, N, K]
    packed, scales, g = quantize_nvfp4(w)
    flat_packed, _, flat_g = quantize_nvfp4(w.reshape(24, 64))
    assert packed.shape == (2, 12, 32) and scales.shape == (2, 12, 4)
    assert torch.equal(packed.reshape(24, 32), flat_packed) and g.item() == flat_g.item()
    deq = dequantize_nvfp4(packed, scales, g, dtype=torch.bfloat16)
    assert deq.shape == w.shape and deq.dtype == torch.bfloat16


def test_global_scale_rule() -> None:
    w = random_rows(8, 64, seed=11)
    amax = w.abs().max()
    _, scales, g = quantize_nvfp4(w)
    assert g.item() == (amax / (6 * 448)).item() == nvfp4_global_scale(amax).item()
    row = int(w.abs().amax(dim=1).argmax())
    block = int(w[row].abs().reshape(-1, 16).amax(dim=1).argmax())
    assert scales[row, block].float().item() == 448.0  # the largest block uses E4M3's top
    ct = compressed_tensors_global_scale(g)  # compressed-tensors stores the reciprocal
    assert ct.item() == pytest.approx(6 * 448 / amax.item(), rel=1e-6)
    assert compressed_tensors_global_scale(ct).item() == pytest.approx(g.item(), rel=1e-6)


def test_round_trip_error_bound() -> None:
    w = random_rows(64, 512, seed=12)
    packed, scales, g = quantize_nvfp4(w)
    deq = dequantize_nvfp4(packed, scales, g)
    unit = (scales.float() * g).repeat_interleave(16, dim=1)  # the block's scale
    # E2M1's largest half-gap is 1 unit (between 4 and 6); saturation costs < 0.375 units
    assert ((deq - w).abs() <= unit * (1 + 1e-6)).all()
    assert ((deq - w).abs() <= 0.25 * unit * (1 + 1e-6))[w.abs() < 2 * unit].all()
    assert (deq - w).norm() / w.norm() < 0.12


def test_nibble_order() -> None:
    w = torch.zeros(1, 16)
    w[0, :4] = torch.tensor([0.5, 6.0, -1.0, 3.0])  # amax 6: block scale 448, unit 1
    packed, scales, g = quantize_nvfp4(w)
    assert scales.float().item() == 448.0
    assert packed[0, :2].tolist() == [0x71, 0x5A]  # element 2i in the low nibble
    assert torch.equal(dequantize_nvfp4(packed, scales, g), w)


def test_zero_blocks_and_zero_tensor() -> None:
    w = random_rows(4, 64, seed=13)
    w[1, 16:32] = 0.0
    packed, scales, g = quantize_nvfp4(w)
    assert scales[1, 1].float().item() == 1.0  # as ModelOpt: a zero block's scale is 1.0
    assert unpack_e2m1(packed)[1, 16:32].eq(0).all()
    packed, scales, g = quantize_nvfp4(torch.zeros(3, 32))
    assert g.item() == 1.0 and scales.float().eq(1.0).all() and packed.eq(0).all()
    deq = dequantize_nvfp4(packed, scales, g)
    assert deq.eq(0).all() and not compressed_tensors_global_scale(g).isinf()


def test_subnormal_and_underflowing_block_scales() -> None:
    w = torch.zeros(1, 64)
    w[0, 0] = 2688.0  # global scale 1.0 exactly
    w[0, 16:20] = torch.tensor([6 * 2.0**-8, 3 * 2.0**-8, -(2.0**-8), 2.0**-9])  # scale 2^-8
    w[0, 32:34] = torch.tensor([6 * 1.5 * 2.0**-9, 2.0**-9])  # scale 1.5 * 2^-9 -> 2^-8 (RNE)
    w[0, 48] = 6 * 2.0**-11  # scale 2^-11: below E4M3's smallest subnormal, rounds to 0
    packed, scales, g = quantize_nvfp4(w)
    assert g.item() == 1.0
    bits = e4m3_bits(scales)[0].tolist()
    assert bits[1] == 0x02 and bits[2] == 0x02 and bits[3] == 0x00  # subnormals, then zero
    codes, want_scales, _ = independent_nvfp4(w)
    assert torch.equal(e4m3_bits(scales), want_scales)
    assert torch.equal(unpack_e2m1(packed)[0, :48], codes[0, :48])
    assert unpack_e2m1(packed)[0, 48:].eq(0).all()  # zero scale: code 0 (ModelOpt: ±6)
    deq = dequantize_nvfp4(packed, scales, g)
    assert torch.equal(deq[0, 16:20], w[0, 16:20])  # exactly representable with scale 2^-8
    # 9 * 2^-9 / 2^-8 = 4.5 units: a tie, to the even code (4); 2^-9 is half a unit, exact
    assert deq[0, 32:34].tolist() == [4 * 2.0**-8, 2.0**-9]
    assert deq[0, 48].item() == 0.0 and torch.isfinite(deq).all()


def test_nan_poisons_the_tensor() -> None:
    w = random_rows(2, 32, seed=14)
    w[0, 0] = float("nan")
    packed, scales, g = quantize_nvfp4(w)
    assert g.isnan() and dequantize_nvfp4(packed, scales, g).isnan().all()


def test_errors() -> None:
    with pytest.raises(ValueError, match="K=24"):
        quantize_nvfp4(torch.randn(2, 24))
    with pytest.raises(ValueError, match="shape"):
        p, s, g = quantize_nvfp4(torch.randn(2, 32))
        dequantize_nvfp4(p, s[:, :1], g)
    _ = decode_e2m1  # re-exported
