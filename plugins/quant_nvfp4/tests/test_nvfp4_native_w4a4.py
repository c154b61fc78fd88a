"""The pieces of ``nvfp4-w4a4-native`` on CPU against the reference (the FP4 GEMM itself
needs compute capability 10.x), and its selection when planning for ``sm_100``."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from kernelbay.cli import main
from kernelbay.device import parse_device
from kernelbay.formats import dequantize_nvfp4, nvfp4_global_scale, quantize_nvfp4
from kernelbay.plan import plan_checkpoint
from kernelbay.plugins import Registry
from kernelbay.requests import LinearRequest
from kernelbay_quant_nvfp4.emulation import Nvfp4EmulationLinear
from kernelbay_quant_nvfp4.native_w4a4 import (
    Nvfp4NativeW4A4Linear,
    quantize_activations_nvfp4,
    swizzle_block_scales,
    unswizzle_block_scales,
    w4a4_alpha,
)
from kernelbay_quant_nvfp4.schemes import nvfp4_scheme
from nvfp4_checkpoints import modelopt_quant

W4A4 = nvfp4_scheme("modelopt", w4a4=True)
W4A16 = nvfp4_scheme("modelopt", w4a4=False)


def _activations(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(9, 96, generator=gen) * torch.logspace(-6, 2, 96)
    x[0] = 0.0
    x[1, 16:32] = -0.0
    x[2, :16] = 1e6  # beyond 6 * 448 * input_scale: block scale saturates at 448
    # Exact E2M1 midpoints and grid points in a block whose scale is exactly 1 (amax 6 with
    # input_scale 1/1): every tie-to-even case.
    g = torch.tensor(1.0)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0,
                         -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, 0.0])
    x[3, 32:48] = ties
    return x, g


def test_activation_quantizer_equals_reference() -> None:
    gen = torch.Generator().manual_seed(3)
    x, g_ties = _activations(gen)
    for g in (nvfp4_global_scale(x[4:].abs().amax()), g_ties, torch.tensor(1e-3)):
        for dtype in (torch.float32, torch.bfloat16):
            xd = x.to(dtype)
            packed, scales = quantize_activations_nvfp4(xd, g)
            ref_packed, ref_scales, _ = quantize_nvfp4(xd, g)
            assert torch.equal(scales.view(torch.uint8), ref_scales.view(torch.uint8))
            assert torch.equal(packed, ref_packed)
    with pytest.raises(ValueError, match="K=40 is not a multiple of the NVFP4 block 16"):
        quantize_activations_nvfp4(torch.ones(2, 40), torch.tensor(1.0))


@pytest.mark.parametrize(("rows", "cols"), [(1, 1), (130, 5), (256, 8), (37, 12)])
def test_swizzle_round_trips_and_pads(rows: int, cols: int) -> None:
    gen = torch.Generator().manual_seed(rows * cols)
    scales = (torch.rand(rows, cols, generator=gen) * 400 + 0.01).to(torch.float8_e4m3fn)
    flat = swizzle_block_scales(scales)
    rp, cp = -(-rows // 128) * 128, -(-cols // 4) * 4
    assert flat.dtype == torch.float8_e4m3fn and flat.shape == (rp * cp,)
    assert torch.equal(unswizzle_block_scales(flat, rows, cols).view(torch.uint8),
                       scales.view(torch.uint8))
    # Padding is zeros, and every real scale appears exactly once.
    assert int((flat.view(torch.uint8) != 0).sum()) == int((scales.view(torch.uint8) != 0).sum())


def test_swizzle_hand_computed_index() -> None:
    """256 x 8 scales = 2 x 2 tiles of 128 x 4. Scale (161, 6) is in tile (1, 1), the fourth
    tile (offset 3 * 512); inside it row 33, column 2: (33 % 32) * 16 + (33 // 32) * 4 + 2 =
    22, so flat index 1558. Scale (5, 1) is in tile (0, 0) at 5 * 16 + 0 + 1 = 81."""
    bits = torch.zeros(256, 8, dtype=torch.uint8)
    bits[161, 6] = 0x38  # 1.0
    bits[5, 1] = 0x40  # 2.0
    flat = swizzle_block_scales(bits.view(torch.float8_e4m3fn)).view(torch.uint8)
    assert flat[1558] == 0x38 and flat[81] == 0x40
    assert int((flat != 0).sum()) == 2


def test_alpha_and_composed_pieces_match_emulation() -> None:
    """The FP4 GEMM's inputs made by the pieces (quantized activations, swizzled scales, alpha),
    read back on CPU through the reference, give nvfp4-emulation's W4A4 output."""
    gen = torch.Generator().manual_seed(11)
    n, k = 48, 96
    packed, scales, g = quantize_nvfp4(torch.randn(n, k, generator=gen))
    x = torch.randn(7, k, generator=gen)
    input_scale = nvfp4_global_scale(x.abs().amax() * 0.8)
    alpha = w4a4_alpha(input_scale, g)
    assert alpha.dtype == torch.float32 and alpha.shape == ()
    assert alpha.item() == pytest.approx(input_scale.item() * g.item(), rel=1e-7)

    xq, xs = quantize_activations_nvfp4(x, input_scale)
    xs_back = unswizzle_block_scales(swizzle_block_scales(xs), 7, k // 16)
    ws_back = unswizzle_block_scales(swizzle_block_scales(scales), n, k // 16)
    one = torch.tensor(1.0)
    acc = dequantize_nvfp4(xq, xs_back, one) @ dequantize_nvfp4(packed, ws_back, one).T
    got = acc * alpha

    method = Nvfp4EmulationLinear(LinearRequest(k, n, W4A4, "float32"))
    layer = torch.nn.Module()
    method.create_weights(layer)
    for name, value in {"weight": packed, "weight_scale": scales, "weight_scale_2": g,
                        "input_scale": input_scale}.items():
        getattr(layer, name).data.copy_(value)
    method.process_weights_after_loading(layer)
    want = method.apply(layer, x)
    # Same products; only where the two global scales are multiplied in differs (fp32).
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_can_implement() -> None:
    req = LinearRequest(4096, 4096, W4A4, "bfloat16")
    assert Nvfp4NativeW4A4Linear.can_implement(req, parse_device("sm_100"))
    assert Nvfp4NativeW4A4Linear.can_implement(req, parse_device("sm_103"))
    for spec in ("sm_90", "sm_120", "cpu"):
        verdict = Nvfp4NativeW4A4Linear.can_implement(req, parse_device(spec))
        assert not verdict.accepted and "compute capability 10.x" in verdict.reason
    weight_only = Nvfp4NativeW4A4Linear.can_implement(LinearRequest(4096, 4096, W4A16),
                                                      parse_device("sm_100"))
    assert not weight_only.accepted and not weight_only.applicable
    ragged = Nvfp4NativeW4A4Linear.can_implement(LinearRequest(4112, 4096, W4A4),
                                                 parse_device("sm_100"))
    assert "K=4112 is not a multiple of 32" in ragged.reason


def test_plans_by_device(modelopt_checkpoint: Callable[..., str], registry: Registry,
                         capsys: pytest.CaptureFixture[str]) -> None:
    """sm_100: native W4A4; sm_90: the Triton weight-only kernel; CPU: the emulation."""
    path = modelopt_checkpoint(modelopt_quant("NVFP4"),
                               lambda m: None if m == "lm_head" else "NVFP4")
    want = {"sm_100": "nvfp4-w4a4-native", "sm_90": "nvfp4-triton", "cpu": "nvfp4-emulation"}
    for spec, method in want.items():
        plan = plan_checkpoint(path, registry=registry, device=parse_device(spec))
        chosen = {d.chosen for d in plan.linears if d.module != "lm_head"}
        assert chosen == {method}, (spec, chosen)
    assert main(["explain", path, "--device", "sm_100"]) == 0
    out = capsys.readouterr().out
    assert "nvfp4-w4a4-native" in out


@pytest.mark.gpu
def test_cuda_fp4_gemm_matches_emulation() -> None:
    """On compute capability 10.x: torch._scaled_mm with the swizzled scales gives the W4A4
    emulation's output (same FP4 operands; the GEMM rounds its output to bf16 before alpha,
    so allow 2^-7 of the output scale)."""
    if torch.cuda.get_device_capability()[0] != 10:
        pytest.skip("needs FP4 tensor cores (compute capability 10.x)")
    gen = torch.Generator().manual_seed(12)
    n, k = 256, 512
    packed, scales, g = quantize_nvfp4(torch.randn(n, k, generator=gen))
    x = torch.randn(37, k, generator=gen).bfloat16().float()  # the same input for both
    input_scale = nvfp4_global_scale(x.abs().amax())
    tensors = {"weight": packed, "weight_scale": scales, "weight_scale_2": g,
               "input_scale": input_scale}
    outs = []
    for cls, device, dtype in ((Nvfp4EmulationLinear, "cpu", "float32"),
                               (Nvfp4NativeW4A4Linear, "cuda", "bfloat16")):
        method = cls(LinearRequest(k, n, W4A4, dtype))
        layer = torch.nn.Module()
        method.create_weights(layer, device=device)
        for name, value in tensors.items():
            getattr(layer, name).data.copy_(value)
        method.process_weights_after_loading(layer)
        xd = x.to(device=device, dtype=getattr(torch, dtype))
        outs.append(method.apply(layer, xd).float().cpu())
    want, got = outs
    torch.testing.assert_close(got, want, rtol=2**-6, atol=2**-7 * float(want.abs().max()))
