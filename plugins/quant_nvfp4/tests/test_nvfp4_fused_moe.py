"""Fused NVFP4 MoE: the folded scalars (g1_alphas, a2_gscale, g1_scale_c ...) against the
unfused reference ``nvfp4-moe-emulation`` for a SiLU-gated MLP, a negative control for the
invalid fold through SiLU, and ``nvfp4-moe-triton`` against the emulation (interpreter cases
in ``triton_interpret_cases.py``; CUDA here)."""

from __future__ import annotations

import pytest
import torch
from kernelbay.device import parse_device
from kernelbay.layers.moe import MOE_EXPERTS_ROLE, expert_tensor
from kernelbay.requests import LinearRequest
from kernelbay_quant_nvfp4.fused_moe import (
    Nvfp4FusedExperts,
    Nvfp4MoETriton,
    fold_moe_scales,
    fused_moe_reference,
)
from kernelbay_quant_nvfp4.moe import Nvfp4MoEEmulation
from kernelbay_quant_nvfp4.schemes import nvfp4_scheme
from moe_helpers import load_moe, quantized_experts, routing

W4A4 = nvfp4_scheme("modelopt", w4a4=True)
W4A16 = nvfp4_scheme("modelopt", w4a4=False)
E, H, INTER, T, TOPK = 4, 64, 48, 11, 2


def _setup(seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen)
    # One gate/up input scale per expert (what a fused GEMM1 needs; ModelOpt exports them
    # so), a down input scale per expert; arbitrary (not powers of two).
    a13 = [float(x.abs().max()) / 2688 * (0.7 + 0.1 * e) for e in range(E)]
    a2 = [0.05 / 2688 * (0.9 + 0.05 * e) for e in range(E)]
    scales = {(e, p): (a2[e] if p == "down_proj" else a13[e])
              for e in range(E) for p in ("gate_proj", "up_proj", "down_proj")}
    return quantized_experts(E, H, INTER, seed, w4a4=True, input_scales=scales), x


def _fused_inputs(tensors: dict[str, torch.Tensor]):  # type: ignore[no-untyped-def]
    def t(e: int, p: str, name: str) -> torch.Tensor:
        return tensors[expert_tensor(e, p, name)]

    experts = Nvfp4FusedExperts(
        torch.stack([torch.cat([t(e, "gate_proj", "weight"), t(e, "up_proj", "weight")])
                     for e in range(E)]),
        torch.stack([torch.cat([t(e, "gate_proj", "weight_scale"),
                                t(e, "up_proj", "weight_scale")]) for e in range(E)]),
        torch.stack([t(e, "down_proj", "weight") for e in range(E)]),
        torch.stack([t(e, "down_proj", "weight_scale") for e in range(E)]))
    scales = fold_moe_scales(
        torch.stack([t(e, "gate_proj", "input_scale") for e in range(E)]),
        torch.stack([torch.stack([t(e, "gate_proj", "weight_scale_2"),
                                  t(e, "up_proj", "weight_scale_2")]) for e in range(E)]),
        torch.stack([t(e, "down_proj", "input_scale") for e in range(E)]),
        torch.stack([t(e, "down_proj", "weight_scale_2") for e in range(E)]))
    return experts, scales


def _unfused(tensors: dict[str, torch.Tensor], x: torch.Tensor, ids: torch.Tensor,
             weights: torch.Tensor) -> torch.Tensor:
    req = LinearRequest(H, INTER, W4A4, "float32", False, MOE_EXPERTS_ROLE, num_experts=E)
    method = Nvfp4MoEEmulation(req)
    return method.apply_moe(load_moe(method, tensors), x, ids, weights)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fused_equals_unfused_reference(seed: int) -> None:
    tensors, x = _setup(seed)
    ids, weights = routing(T, E, TOPK, seed)
    experts, scales = _fused_inputs(tensors)
    torch.testing.assert_close(scales.g1_scale_c, scales.g1_alphas * scales.a2_gscale[:, None])
    got = fused_moe_reference(x, ids, weights, experts, scales)
    want = _unfused(tensors, x, ids, weights)
    # The same quantized operands and products; only the order in which the fp32 global
    # factors multiply differs (a few ulps), which can move a value across an E2M1 or E4M3
    # rounding boundary only in rare ties: allow 1e-4 of the output's scale.
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_folding_through_silu_changes_the_result() -> None:
    """Negative control: g1_scale_c applied to the gate before SiLU (SiLU(c t) != c SiLU(t))
    moves the output far beyond the tolerance above."""
    tensors, x = _setup(0)
    ids, weights = routing(T, E, TOPK, 0)
    experts, scales = _fused_inputs(tensors)
    right = fused_moe_reference(x, ids, weights, experts, scales)
    wrong = fused_moe_reference(x, ids, weights, experts, scales, fold_through_activation=True)
    rel = float((wrong - right).abs().max() / right.abs().max())
    assert rel > 0.1, rel


def test_triton_moe_verdicts() -> None:
    req = LinearRequest(H, INTER, W4A4, "bfloat16", False, MOE_EXPERTS_ROLE, num_experts=E)
    ok = Nvfp4MoETriton.can_implement(req, parse_device("sm_90"))
    assert ok.accepted and "input_scale is not used" in ok.describe()
    cpu = Nvfp4MoETriton.can_implement(req, parse_device("cpu"))
    assert not cpu.accepted and "ROCm GPU" in cpu.reason
    dense = LinearRequest(H, INTER, W4A16, "bfloat16")
    assert not Nvfp4MoETriton.can_implement(dense, parse_device("sm_90")).applicable


@pytest.mark.parametrize("layout, n, k, turn", [
    ("tiles", 128, 256, 64), ("tiles", 48, 128, 32), ("fragment", 40, 64, 64),
    ("checkpoint", 24, 48, 16), ("repacked", 12, 32, 8)])
def test_paired_weight_takes_gate_and_up_in_turns(layout: str, n: int, k: int,
                                                  turn: int) -> None:
    """The paired gate/up weight holds ``turn`` gate rows then ``turn`` up rows, in turns,
    each projection zero-padded to whole turns (built here slice by slice); the scales move
    with their rows and each projection keeps its own global scale."""
    from kernelbay_quant_nvfp4.grouped_weights import (
        ROW_UNIT,
        expert_weight,
        pair_turn,
        paired_weight,
    )
    from kernelbay_quant_nvfp4.linear_triton import layout_tensors

    experts = 2
    gen = torch.Generator().manual_seed(n)

    def projection(scale: float):  # type: ignore[no-untyped-def]
        packed = torch.randint(0, 256, (experts, n, k // 2), dtype=torch.uint8, generator=gen)
        codes = torch.randint(1, 120, (experts, n, k // 16), dtype=torch.uint8, generator=gen)
        words, scales = layout_tensors(packed, codes.view(torch.float8_e4m3fn), layout)
        return expert_weight(words, scales, torch.full((experts, 1), scale), layout, n, k)

    gate, up = projection(1.0), projection(2.0)
    paired = paired_weight(gate, up, turn)
    turns = -(-n // turn)
    assert (paired.rows, paired.turn, paired.n, paired.k) == (2 * turns * turn, turn, n, k)
    assert paired.global_scale is gate.global_scale and paired.up_scale is up.global_scale
    per = turn // ROW_UNIT[layout]  # stored rows per turn

    def expected(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        g, u = (t.reshape(experts, -(-n // ROW_UNIT[layout]), -1) for t in (g, u))
        pieces = []
        for j in range(turns):
            for src in (g, u):
                piece = src[:, j * per:(j + 1) * per]
                pad = per - piece.shape[1]
                pieces += [piece, src.new_zeros(experts, pad, src.shape[2])] if pad else [piece]
        return torch.cat(pieces, 1)

    for got, g, u in ((paired.words, gate.words, up.words), (paired.scales, gate.scales,
                                                            up.scales)):
        assert torch.equal(got.reshape(experts, 2 * turns * per, -1), expected(g, u))
    assert pair_turn(2048) == 64 and pair_turn(40) == 64 and pair_turn(20) == 32
    assert pair_turn(3) == 8


def test_paired_weight_names_a_bad_turn_or_mismatch() -> None:
    from kernelbay_quant_nvfp4.grouped_weights import expert_weight, paired_weight

    w = torch.zeros(1, 32, 8, dtype=torch.int32)
    s = torch.zeros(1, 32, 4, dtype=torch.uint8)
    g = torch.ones(1, 1)
    gate = expert_weight(w, s, g, "repacked", 32, 64)
    for turn in (0, 4, 24):
        with pytest.raises(ValueError, match=rf"turn={turn}; valid: a power of two >= 8"):
            paired_weight(gate, gate, turn)
    other = expert_weight(w[:, :16], s[:, :16], g, "repacked", 16, 64)
    with pytest.raises(ValueError, match=r"gate 32x64 .* up 16x64 .* matching"):
        paired_weight(gate, other, 16)
    tiles = expert_weight(torch.zeros(1, 2, 1, 256, dtype=torch.int32),
                          torch.zeros(1, 2, 1, 128, dtype=torch.uint8), g, "tiles", 32, 128)
    with pytest.raises(ValueError, match="turn=8; valid: a power of two >= 16"):
        paired_weight(tiles, tiles, 8)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens, top_k, hidden", [
    (1, 2, 512), (40, 2, 512), (300, 2, 512),  # 16-, 16- and 64-row blocks
    (1, 1, 1024), (3, 2, 2048)])  # few programs: the gate/up GEMM splits K (one slot first)
def test_cuda_triton_moe_matches_emulation(tokens: int, top_k: int, hidden: int) -> None:
    from moe_helpers import check_moe_triton

    check_moe_triton("cuda", experts=8, hidden=hidden, inter=256, tokens=tokens, top_k=top_k)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens, hidden, edges", [
    (1, 512, 3), (40, 512, 5),  # no split of K; 80 slots: the routing's own two edges
    (1, 1024, 4)])  # the gate/up GEMM splits K in two: its finish depends on it
def test_cuda_triton_moe_as_programmatic_dependents(tokens: int, hidden: int, edges: int,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside a CUDA graph the gate/up GEMM depends programmatically on the routing's last
    launch (its split-K finish on it), the down GEMM on the gate/up one and the slot sum on
    the down one, plus the multi-program routing's own two edges above 64 slots, with the bits
    of plain launches for fresh activations on every replay; bf16 routing weights, converted
    before the routing."""
    from kernelbay.cuda_jit import programmatic_launch
    from kernelbay.testing.programmatic import check_programmatic_chain

    monkeypatch.setenv("KERNELBAY_PDL", "1")
    if not programmatic_launch():
        pytest.skip("programmatic launches need compute capability 9.0 or newer")
    experts, inter = 8, 256
    req = LinearRequest(hidden, inter, W4A16, "bfloat16", False, MOE_EXPERTS_ROLE,
                        num_experts=experts)
    method = Nvfp4MoETriton(req)
    tensors = quantized_experts(experts, hidden, inter, 5, w4a4=False)
    layer = load_moe(method, {k: v.cuda() for k, v in tensors.items()}, "cuda")
    ids, weights = routing(tokens, experts, 2, 6)
    ids, weights = ids.cuda(), weights.bfloat16().cuda()
    gen = torch.Generator().manual_seed(7)
    inputs = [torch.randn(tokens, hidden, generator=gen).bfloat16().cuda() for _ in range(3)]
    check_programmatic_chain(monkeypatch, [lambda x: method.apply_moe(layer, x, ids, weights)],
                             inputs, edges=edges)


@pytest.mark.gpu
def test_cuda_triton_moe_replays_from_a_cuda_graph_with_new_routing() -> None:
    """The grouped experts are captured as they run: a graph captured with one routing,
    replayed with another written into the same tensors, gives the eager result of the new
    routing (nothing about the routing was fixed on the host at capture)."""
    experts, hidden, inter, tokens = 8, 1024, 128, 6  # the gate/up GEMM splits K in two
    req = LinearRequest(hidden, inter, W4A16, "bfloat16", False, MOE_EXPERTS_ROLE,
                        num_experts=experts)
    method = Nvfp4MoETriton(req)
    tensors = quantized_experts(experts, hidden, inter, 3, w4a4=False)
    layer = load_moe(method, {k: v.cuda() for k, v in tensors.items()}, "cuda")
    x = torch.randn(tokens, hidden, device="cuda").bfloat16()
    ids, weights = (t.cuda() for t in routing(tokens, experts, 2, 4))
    method.apply_moe(layer, x, ids, weights)  # compiles outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = method.apply_moe(layer, x, ids, weights)
    torch.cuda.current_stream().wait_stream(stream)
    new_ids, new_weights = routing(tokens, experts, 2, 9)
    assert not torch.equal(new_ids, ids.cpu())
    ids.copy_(new_ids)
    weights.copy_(new_weights)
    x.copy_(torch.randn(tokens, hidden).bfloat16())
    graph.replay()
    torch.cuda.synchronize()
    want = method.apply_moe(layer, x, ids, weights)
    assert torch.equal(out, want)


@pytest.mark.parametrize("mode", ["gate_up", "gate_up_split", "gate_up_finish", "down"])
def test_grouped_kernel_compiles_for_sm90_with_one_slot(mode: str) -> None:
    """The grouped kernel compiled for sm_90 on the CPU (ptxas, no GPU) in each of its modes,
    with the slot count a compile-time 1 as Triton specializes it at one routed slot (top-1 at
    one token): the interpreter never specializes, so only a compile shows such a failure."""
    pytest.importorskip("triton")
    from kernelbay.testing.triton_compile import compile_for_cuda
    from kernelbay_quant_nvfp4.triton_grouped import nvfp4_grouped_gemm

    values = {"num_slots": 1, "TOP_K": 1, "GATED": mode != "down", "BLOCK_M": 16,
              "BLOCK_N": 128, "BLOCK_K": 256, "EVEN_K": True, "ASM": True,
              "INTERPRET": False, "REPACKED": True, "SWAP": True, "TILED": True,
              "SPLIT": 2 if "split" in mode or "finish" in mode else 1,
              "FINISH": mode == "gate_up_finish"}
    from kernelbay.triton_pdl import SUPPORTED

    values["PDL"] = SUPPORTED  # built as CUDA runs it: waiting and releasing
    pointers = {"x_ptr": "*bf16", "slot_ptr": "*i32", "expert_ptr": "*i32", "w_ptr": "*i32",
                "s_ptr": "*u8", "g_ptr": "*fp32", "ug_ptr": "*fp32", "rw_ptr": "*fp32",
                "out_ptr": "*bf16" if mode != "down" else "*fp32", "part_ptr": "*fp32"}
    compiled = compile_for_cuda(nvfp4_grouped_gemm, values, pointers, num_warps=4,
                                num_stages=3)
    assert "ptx" in compiled.asm
