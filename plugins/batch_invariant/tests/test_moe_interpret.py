"""``bi-triton-moe`` against the core's ``torch-moe`` (Triton interpreter, tiny shapes), and
a token's output whatever else the batch routes."""

from __future__ import annotations

import pytest
import torch
from kernelbay import LayerRole, LinearRequest, parse_device
from kernelbay.layers.moe import TorchMoE
from kernelbay_batch_invariant.moe import BatchInvariantMoE

# Tensors live on the CPU and the kernels run in the interpreter; test_gpu.py covers CUDA.
pytestmark = [pytest.mark.skipif(torch.cuda.is_available(),
                                 reason="interpreter tests (CPU tensors); test_gpu.py runs on CUDA"),
              pytest.mark.triton_interpreter]


def _layer(method: TorchMoE, seed: int) -> torch.nn.Module:
    layer = torch.nn.Module()
    method.create_weights(layer)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    method.process_weights_after_loading(layer)
    return layer


def test_matches_torch_moe_and_rows_are_invariant() -> None:
    request = LinearRequest(32, 24, activation_dtype="float32", role=LayerRole.MOE_EXPERT,
                            num_experts=4)
    ours, ref = BatchInvariantMoE(request), TorchMoE(request)
    layer = _layer(ours, 1)
    ref_layer = _layer(ref, 1)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(7, 32, generator=g)
    ids = torch.randint(0, 4, (7, 2), generator=g)
    ids[:, 1] = (ids[:, 0] + 1) % 4
    weights = torch.rand(7, 2, generator=g)
    out = ours.apply_moe(layer, x, ids, weights)
    torch.testing.assert_close(out, ref.apply_moe(ref_layer, x, ids, weights), atol=1e-4,
                               rtol=1e-4)
    alone = ours.apply_moe(layer, x[-1:], ids[-1:], weights[-1:])
    assert torch.equal(alone[0], out[-1])


def test_verdicts() -> None:
    request = LinearRequest(32, 24, role=LayerRole.MOE_EXPERT, num_experts=4)
    assert BatchInvariantMoE.can_implement(request, parse_device("sm_90")).accepted
    cpu = BatchInvariantMoE.can_implement(request, parse_device("cpu"))
    assert not cpu.accepted and "device platform is 'cpu'" in cpu.reason
