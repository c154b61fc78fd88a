"""Shared pieces of the NVFP4 MoE tests: quantized experts, loading a MoE method, routing,
and the Triton-vs-emulation check (run in the interpreter and on CUDA)."""

from __future__ import annotations

import torch
from kernelbay.formats import quantize_nvfp4
from kernelbay.layers.moe import MOE_EXPERTS_ROLE, MoEMethod, expert_tensor
from kernelbay.requests import LinearRequest
from kernelbay_quant_nvfp4.schemes import nvfp4_scheme

PROJ = ("gate_proj", "up_proj", "down_proj")


def quantized_experts(experts: int, hidden: int, inter: int, seed: int, *, w4a4: bool,
                      input_scales: dict[tuple[int, str], float] | None = None
                      ) -> dict[str, torch.Tensor]:
    """Random experts quantized by the reference, by canonical per-expert name."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {"gate_proj": (inter, hidden), "up_proj": (inter, hidden),
              "down_proj": (hidden, inter)}
    out: dict[str, torch.Tensor] = {}
    for e in range(experts):
        for p in PROJ:
            w = torch.randn(*shapes[p], generator=gen) * 0.1
            if e == 0 and p == "down_proj":
                w[:3] = 0.0  # zero rows
            packed, scales, g = quantize_nvfp4(w)
            out[expert_tensor(e, p)] = packed
            out[expert_tensor(e, p, "weight_scale")] = scales
            out[expert_tensor(e, p, "weight_scale_2")] = g
            if w4a4:
                assert input_scales is not None
                out[expert_tensor(e, p, "input_scale")] = torch.tensor(input_scales[(e, p)])
    return out


def load_moe(method: MoEMethod, tensors: dict[str, torch.Tensor],
             device: str = "cpu") -> torch.nn.Module:
    """Create the method's parameters on ``device``, load ``tensors``, finish loading."""
    layer = torch.nn.Module()
    method.create_weights(layer, device=device)
    specs = method.tensor_specs()
    for name, value in tensors.items():
        if name in specs:
            getattr(layer, name).data.copy_(value)
    method.process_weights_after_loading(layer)
    return layer


def routing(tokens: int, experts: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct top-k expert ids per token and positive routing weights."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)]
                      ) if tokens else torch.zeros(0, k, dtype=torch.long)
    return ids, torch.rand(tokens, k, generator=gen) + 0.1


def check_moe_triton(device: str, *, experts: int, hidden: int, inter: int,
                     tokens: int, top_k: int = 2,
                     layouts: tuple[str, str] | None = None) -> None:
    """``nvfp4-moe-triton`` against ``nvfp4-moe-emulation`` (both weight-only, bf16);
    ``layouts``: the stored layouts of gate/up and down the caller expects.

    Both use the same bf16-rounded weights; the emulation rounds each F.linear output to
    bf16, the kernel its fp32 sum, so values differ by a few bf16 units of the intermediate
    results: the check allows 2^-5 of the output's scale, far below what a wrong expert,
    nibble or scale gives (O(1) of it).
    """
    from kernelbay_quant_nvfp4.fused_moe import Nvfp4MoETriton
    from kernelbay_quant_nvfp4.moe import Nvfp4MoEEmulation

    scheme = nvfp4_scheme("modelopt", w4a4=False)
    req = LinearRequest(hidden, inter, scheme, "bfloat16", False, MOE_EXPERTS_ROLE,
                        num_experts=experts)
    tensors = quantized_experts(experts, hidden, inter, 5, w4a4=False)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(tokens, hidden, generator=gen).bfloat16()
    ids, weights = routing(tokens, experts, top_k, 7)
    want = Nvfp4MoEEmulation(req).apply_moe(
        load_moe(Nvfp4MoEEmulation(req), tensors), x, ids, weights)
    method = Nvfp4MoETriton(req)
    layer = load_moe(method, {k: v.to(device) for k, v in tensors.items()}, device)
    if layouts is not None:  # the stored layouts (gate/up, down) the case is meant to reach
        assert method.layouts == layouts, method.layouts
    got = method.apply_moe(layer, x.to(device), ids.to(device), weights.to(device)).cpu()
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    scale = float(want.float().abs().amax()) if want.numel() else 1.0
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-5, atol=2**-5 * scale)
