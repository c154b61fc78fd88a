"""``fp8-pb-wo-triton``: selection for the FP8_PB_WO layers of a MIXED_PRECISION checkpoint by
device, and its verdicts. (Its numbers against the reference run in Triton's interpreter:
``triton_interpret_cases.test_fp8_block_pads_inside_the_method``.)"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from kernelbay.device import parse_device
from kernelbay.formats import dequantize_fp8_per_block, quantize_fp8_per_block
from kernelbay.plan import plan_checkpoint
from kernelbay.plugins import Registry
from kernelbay.requests import LinearRequest, QuantScheme
from kernelbay_quant_nvfp4.fp8_block import Fp8BlockTritonLinear, pad_fp8_block
from nvfp4_checkpoints import modelopt_quant

FP8_PB = QuantScheme("fp8-block", "float8_e4m3fn", (128, 128), "float32", False, None,
                     "modelopt")
Q = "model.layers.0.self_attn.q_proj"
MIXED = {Q: {"quant_algo": "NVFP4", "group_size": 16},
         "model.layers.1.mlp.down_proj": {"quant_algo": "FP8_PB_WO"},
         "model.layers.0.mlp.gate_proj": {"quant_algo": "FP8_PB_WO"}}


def test_mixed_precision_selection_by_device(modelopt_checkpoint: Callable[..., str],
                                             registry: Registry) -> None:
    """GPU: the Triton kernels for both schemes (the FP8 layers' N, K = 128/64 are ragged
    against the 128 tile); CPU: this plugin leaves FP8 to the core (or cpu_amx) and NVFP4
    to its emulation."""
    path = modelopt_checkpoint(modelopt_quant("MIXED_PRECISION", quantized_layers=MIXED),
                               lambda m: MIXED.get(m, {}).get("quant_algo"))
    want = {"sm_90": {Q: "nvfp4-triton", "model.layers.1.mlp.down_proj": "fp8-pb-wo-triton",
                      "model.layers.0.mlp.gate_proj": "fp8-pb-wo-triton"},
            "cpu": {Q: "nvfp4-emulation", "model.layers.1.mlp.down_proj": "torch-fp8-dequant",
                    "model.layers.0.mlp.gate_proj": "torch-fp8-dequant"}}
    for spec, chosen in want.items():
        plan = plan_checkpoint(path, registry=registry, device=parse_device(spec))
        got = {d.module: d.chosen for d in plan.linears if d.module in chosen}
        assert got == chosen, spec


def test_verdicts() -> None:
    ok = Fp8BlockTritonLinear.can_implement(LinearRequest(300, 200, FP8_PB), parse_device("sm_90"))
    assert ok.accepted
    cases = {
        "CUDA (compute capability >= 8.0) or ROCm GPU":
            (LinearRequest(300, 200, FP8_PB), "cpu+amx"),
        "needs 128x128 scale tiles": (LinearRequest(256, 256, QuantScheme(
            "fp8-block", "float8_e4m3fn", (1, 128), "float32")), "sm_90"),
        "shard of 100 is not a multiple of the 128 scale tile": (LinearRequest(
            100, 256, FP8_PB, parallel="row", tp_rank=0, tp_size=2), "sm_90x2"),
    }
    for needle, (request, spec) in cases.items():
        verdict = Fp8BlockTritonLinear.can_implement(request, parse_device(spec))
        assert not verdict.accepted and needle in verdict.reason, verdict.reason


@pytest.mark.parametrize(("n", "k"), [(200, 300), (128, 128), (1, 129)])
def test_padding_is_zero_and_keeps_the_reference_values(n: int, k: int) -> None:
    q, s = quantize_fp8_per_block(torch.randn(n, k) * 5)
    padded = pad_fp8_block(q)
    assert padded.shape == (-(-n // 128) * 128, -(-k // 128) * 128)
    assert torch.equal(padded[:n, :k].view(torch.uint8), q.view(torch.uint8))
    assert int(padded.view(torch.uint8).sum()) == int(q.view(torch.uint8).sum())
    dense = dequantize_fp8_per_block(padded, s)
    assert torch.equal(dense[:n, :k], dequantize_fp8_per_block(q, s))


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "k"), [(4096, 4096), (1000, 3000), (8192, 28672)])
def test_cuda_matches_reference(n: int, k: int) -> None:
    from nvfp4_triton_helpers import check_close

    gen = torch.Generator().manual_seed(n + k)
    q, s = quantize_fp8_per_block(torch.randn(n, k, generator=gen))
    method = Fp8BlockTritonLinear(LinearRequest(k, n, FP8_PB, "bfloat16"))
    layer = torch.nn.Module()
    method.create_weights(layer, device="cuda")
    layer.weight.data.copy_(q.cuda())
    layer.weight_scale.data.copy_(s.cuda())
    method.process_weights_after_loading(layer)
    w = dequantize_fp8_per_block(q, s).cuda()
    for m in (1, 16, 64, 300):
        x = torch.randn(m, k, generator=gen).bfloat16().cuda()
        check_close(method.apply(layer, x), x, w, None)
