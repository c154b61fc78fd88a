"""The grouped MXFP4 expert GEMM (``triton_grouped``) against ``dequantize_mx`` + a float64
matmul per slot, and ``mxfp4-moe-triton`` inside a simulated CUDA-graph capture. Under the
interpreter without a GPU (tiny shapes)."""

from __future__ import annotations

import pytest
import torch
from kernelbay.formats import dequantize_mx, quantize_mx
from kernelbay.layers.expert_blocks import expert_blocks
from kernelbay.layers.moe import CAPTURED_EXPERTS_PER_ROUTED

pytest.importorskip("triton")

from kernelbay_quant_mxfp4_rocm.moe import Mxfp4MoEEmulation
from kernelbay_quant_mxfp4_rocm.triton_grouped import (
    EXPERT_LAYOUTS,
    GroupedConfig,
    block_rows,
    expert_layout,
    grouped_mxfp4_gemm,
    layout_experts,
)
from kernelbay_quant_mxfp4_rocm.triton_moe import Mxfp4MoETriton
from test_mxfp4_moe import _load, _request, _routing, _weights, mx

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":  # the kernels run under Triton's interpreter (conftest)
    pytestmark = pytest.mark.triton_interpreter


def _experts(experts: int, n: int, k: int, gen: torch.Generator
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed E2M1 [E, N, K/2] and E8M0 bytes [E, N, K/32] with edge cases: a zero row, the
    subnormal scale 2^-127 (byte 0) and byte 1, scales near the top of float32's range (whose
    products still sum without overflow), and a NaN block
    (byte 255) in the last expert."""
    packed, scales = quantize_mx(torch.randn(experts * n, k, generator=gen), "e2m1", "even")
    packed, scales = packed.view(experts, n, k // 2), scales.view(experts, n, k // 32).clone()
    packed[0, 0] = 0
    scales[0, 1, 0], scales[0, 2, -1] = 0, 1
    scales[1 % experts, 3, 0], scales[1 % experts, 4, -1] = 240, 244
    scales[-1, -1, -1] = 255
    return packed, scales


def _want(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor,
          gather: bool, gated: bool = False, weights: torch.Tensor | None = None
          ) -> torch.Tensor:
    """Row s: the input row times expert ids.flatten()[s]'s dequantized weight, float64
    (``gated``: SiLU of the first half of the columns times the second; ``weights``: times the
    slot's weight)."""
    dense = dequantize_mx(packed, scales, "e2m1").double()
    flat = ids.reshape(-1)
    rows = torch.arange(flat.numel()) // ids.shape[1] if gather else torch.arange(flat.numel())
    out = torch.stack([x[r].double() @ dense[e].T for r, e in zip(rows, flat.tolist(),
                                                                  strict=True)])
    if gated:
        gate, up = out.chunk(2, dim=-1)
        out = torch.nn.functional.silu(gate) * up
    return out if weights is None else out * weights.reshape(-1, 1).double()


@pytest.mark.parametrize(("tokens", "top_k", "experts", "n", "k", "block_m"), [
    (5, 2, 3, 40, 96, 16),     # ragged N and K (K not a multiple of the 64-element tile)
    (1, 4, 6, 32, 64, 16),     # one token, experts unused
    (37, 3, 4, 24, 128, 32),   # blocks of 32 rows, experts with several blocks
    (45, 3, 2, 16, 64, 64),    # blocks of 64 rows
])
@pytest.mark.parametrize(("gather", "gated", "weighted"), [
    (True, False, False), (False, False, False), (True, True, False), (False, False, True),
    (True, True, True)])
@pytest.mark.parametrize("layout", EXPERT_LAYOUTS)
def test_grouped_gemm_matches_the_reference(tokens: int, top_k: int, experts: int, n: int,
                                            k: int, block_m: int, gather: bool, gated: bool,
                                            weighted: bool, layout: str) -> None:
    """Plain, gated (gate/up rows with SwiGLU in float32) and weighted by routing weights,
    from the checkpoint bytes and from the fragment-order words (the transposed product)."""
    gen = torch.Generator().manual_seed(tokens * 100 + n)
    packed, scales = _experts(experts, n, k, gen)
    stored = layout_experts(packed, layout)
    assert expert_layout(stored) == layout
    ids = torch.randint(0, experts, (tokens, top_k), generator=gen)
    ids[0] = ids[0, 0]  # a token routed to the same expert twice
    rows = tokens if gather else tokens * top_k
    x = torch.randn(rows, k, generator=gen).bfloat16()
    x[-1, :32] = 0.0
    blocks = expert_blocks(ids.to(DEVICE), experts, block_m)
    weights = torch.rand(tokens, top_k, generator=gen) if weighted else None
    got = grouped_mxfp4_gemm(x.to(DEVICE), stored.to(DEVICE), scales.to(DEVICE), blocks,
                             gather=gather, gated=gated, out_dtype=torch.float32,
                             routing_weights=None if weights is None else weights.to(DEVICE)
                             ).cpu()
    want = _want(x, packed, scales, ids, gather, gated, weights)
    nan = want.isnan()  # the NaN block reaches the rows routed to the last expert
    assert torch.equal(got.isnan(), nan)
    # exact products, float32 sums in another order than float64's (and float32 SiLU)
    torch.testing.assert_close(got[~nan].double(), want[~nan], rtol=1e-5,
                               atol=1e-5 * float(want[~nan].abs().max()) if gated else 1e-30)


def test_bf16_output_is_the_rounded_float32_result() -> None:
    gen = torch.Generator().manual_seed(5)
    packed, scales = quantize_mx(torch.randn(2 * 48, 64, generator=gen), "e2m1", "even")
    packed, scales = packed.view(2, 48, 32).to(DEVICE), scales.view(2, 48, 2).to(DEVICE)
    ids = torch.tensor([[0, 1], [1, 1], [1, 0]], device=DEVICE)
    x = torch.randn(3, 64, generator=gen).bfloat16().to(DEVICE)
    blocks = expert_blocks(ids, 2, 16)
    for gated in (False, True):  # gated: SiLU(gate) * up, what the MoE layer stores in bf16
        wide = grouped_mxfp4_gemm(x, packed, scales, blocks, gather=True, gated=gated,
                                  out_dtype=torch.float32)
        narrow = grouped_mxfp4_gemm(x, packed, scales, blocks, gather=True, gated=gated,
                                    out_dtype=torch.bfloat16)
        assert narrow.dtype == torch.bfloat16 and torch.equal(narrow, wide.bfloat16())


def test_bad_operands_name_what_was_expected() -> None:
    packed = torch.zeros(2, 8, 32, dtype=torch.uint8)
    scales = torch.zeros(2, 8, 2, dtype=torch.uint8)
    blocks = expert_blocks(torch.tensor([[0, 1]]), 2, 16)
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"weight must be packed E2M1 uint8 \[E, N, K/2\] or "
                       r"fragment-order words int32 \[E, N, K/32, 4\], got torch.uint8 "
                       r"\(8, 32\)"):
        grouped_mxfp4_gemm(x, packed[0], scales, blocks, gather=True, out_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"expert layout 'k'; valid: \('checkpoint', "
                       r"'fragment'\)"):
        layout_experts(packed, "k")
    with pytest.raises(ValueError, match=r"weight_scale must be uint8 \[2, 8, 1\]"):
        # fragment words of K = 32: the scales must follow the words' K
        grouped_mxfp4_gemm(x, layout_experts(packed, "fragment")[:, :, :1], scales, blocks,
                           gather=True, out_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"weight_scale must be uint8 \[2, 8, 2\]"):
        grouped_mxfp4_gemm(x, packed, scales[:, :, :1], blocks, gather=True,
                           out_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"x must be bfloat16 \[2, 64\]"):
        grouped_mxfp4_gemm(x, packed, scales, blocks, gather=False, out_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"routing_weights must hold one weight per slot \(2\)"):
        grouped_mxfp4_gemm(x, packed, scales, blocks, gather=True, out_dtype=torch.float32,
                           routing_weights=torch.ones(3))
    with pytest.raises(ValueError, match="gated weight rows must be gate then up"):
        grouped_mxfp4_gemm(x, packed[:, :7], scales[:, :7], blocks, gather=True, gated=True,
                           out_dtype=torch.float32)
    for bad, name in ((GroupedConfig(16, 48, 1, 1), "block_k=48"),
                      (GroupedConfig(8, 64, 1, 1), "block_n=8")):
        with pytest.raises(ValueError, match=f"{name}; valid: a power of two"):
            grouped_mxfp4_gemm(x, packed, scales, blocks, gather=True, out_dtype=torch.float32,
                               config=bad)


def test_block_rows_grow_with_the_slots_per_expert() -> None:
    assert block_rows(8, 256) == 16  # one decode token, top-8
    assert block_rows(256 * 20, 256) == 32
    assert block_rows(4096 * 8, 256) == 64
    assert block_rows(0, 4) == 16


@pytest.mark.parametrize("activation", [None, "mxfp4-dynamic"])
def test_moe_runs_inside_a_capture_as_eagerly(activation: str | None) -> None:
    """Nothing on the host: the layer runs inside a (simulated) capture exactly as eagerly,
    also where running every expert on every token would be refused (16 experts, 2 routed)."""
    from kernelbay.testing.capture import simulated_capture  # imports the engine

    experts, hidden, inter = 2 * CAPTURED_EXPERTS_PER_ROUTED, 64, 32
    request = _request(mx(activation), experts, hidden, inter)
    method, emulation = Mxfp4MoETriton(request), Mxfp4MoEEmulation(request)
    weights = _weights(experts, hidden, inter, 9)
    layer, layer_e = _load(method, weights).to(DEVICE), _load(emulation, weights)
    ids, topk = _routing(1, experts, 2, 10)
    x = torch.randn(1, hidden, generator=torch.Generator().manual_seed(11)).bfloat16()
    args = (x.to(DEVICE), ids.to(DEVICE), topk.to(DEVICE))
    eager = method.apply_moe(layer, *args)
    with simulated_capture():
        captured = method.apply_moe(layer, *args)
    assert torch.equal(captured, eager)
    want = emulation.apply_moe(layer_e, x, ids, topk).float()
    err = (eager.cpu().float() - want).norm() / want.norm()
    assert err < 2**-8, err.item()
    empty = method.apply_moe(layer, *(a[:0] for a in args))
    assert empty.shape == (0, hidden) and empty.dtype == torch.bfloat16


@pytest.mark.parametrize("activation", [None, "mxfp4-dynamic"])
def test_the_moe_layer_gives_one_result_from_either_expert_layout(
        activation: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The layer with its experts stored as this machine stores them and as the other layout
    (``prepare_experts`` told the PTX decode does or does not apply), K not a multiple of the
    K tile: the same products, summed in another order at most."""
    from kernelbay_quant_mxfp4_rocm import triton_gemm

    experts, hidden, inter = 4, 160, 96
    request = _request(mx(activation), experts, hidden, inter)
    weights = _weights(experts, hidden, inter, 21)
    ids, topk = _routing(5, experts, 2, 22)
    x = torch.randn(5, hidden, generator=torch.Generator().manual_seed(23)).bfloat16()
    args = (x.to(DEVICE), ids.to(DEVICE), topk.to(DEVICE))
    method = Mxfp4MoETriton(request)
    native = _load(method, weights).to(DEVICE)
    here = triton_gemm._asm_target()
    monkeypatch.setattr(triton_gemm, "_asm_target", lambda: not here)
    other = _load(method, weights).to(DEVICE)
    layouts = {expert_layout(layer.w13.data) for layer in (native, other)}
    assert layouts == set(EXPERT_LAYOUTS)
    want, got = method.apply_moe(native, *args).float(), method.apply_moe(other, *args).float()
    torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7 * float(want.abs().max()))


def test_config_text_round_trips_and_bad_text_is_named() -> None:
    config = GroupedConfig.parse("n128k256w8s4")
    assert config == GroupedConfig(128, 256, 8, 4) and config.name == "n128k256w8s4"
    with pytest.raises(ValueError, match="expected n<block_n>k<block_k>w<warps>s<stages>"):
        GroupedConfig.parse("n64w4s3")
    with pytest.raises(ValueError, match="block_k=48; valid: a power of two >= 32"):
        GroupedConfig.parse("n64k48w4s3")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 40])
def test_the_moe_layer_as_programmatic_dependents(tokens: int,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """W4A16 inside a CUDA graph, bf16 routing weights (converted before the routing): the
    gate/up GEMM depends programmatically on the routing's last launch, the down GEMM on the
    gate/up one and the slot sum on the down one (plus the multi-program routing's own two
    edges above 64 slots), with the bits of plain launches for fresh activations on every
    replay."""
    from kernelbay.cuda_jit import programmatic_launch
    from kernelbay.testing.programmatic import check_programmatic_chain

    monkeypatch.setenv("KERNELBAY_PDL", "1")
    if not programmatic_launch():
        pytest.skip("programmatic launches need compute capability 9.0 or newer")
    experts, hidden, inter = 8, 256, 128
    method = Mxfp4MoETriton(_request(mx(), experts, hidden, inter))
    layer = _load(method, _weights(experts, hidden, inter, 31)).to(DEVICE)
    ids, topk = _routing(tokens, experts, 2, 32)
    ids, topk = ids.to(DEVICE), topk.bfloat16().to(DEVICE)  # converted before the routing
    gen = torch.Generator().manual_seed(33)
    inputs = [torch.randn(tokens, hidden, generator=gen).bfloat16().to(DEVICE)
              for _ in range(3)]
    check_programmatic_chain(monkeypatch, [lambda x: method.apply_moe(layer, x, ids, topk)],
                             inputs, edges=3 + (2 if tokens * 2 > 64 else 0))


_COMPILE_SM90 = """
import sys
from kernelbay.testing.triton_compile import compile_for_cuda
from kernelbay.triton_pdl import SUPPORTED
from kernelbay_quant_mxfp4_rocm.triton_grouped import _grouped_kernel

gated = sys.argv[1] == "gated"
values = {"ROW_DIV": 8 if gated else 1, "GATED": gated, "WEIGHTED": not gated,
          "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "EVEN_K": True, "ASM": True,
          "FAST": True, "FRAGMENT": True, "INTERPRET": False, "OUT_BF16_BITS": False,
          "PDL": SUPPORTED}
types = {"x_ptr": "*bf16", "slot_ptr": "*i32", "expert_ptr": "*i32", "w_ptr": "*i32",
         "s_ptr": "*u8", "rw_ptr": "*fp32", "out_ptr": "*bf16" if gated else "*fp32"}
compiled = compile_for_cuda(_grouped_kernel, values, types, num_warps=4, num_stages=3)
assert ("griddepcontrol.wait" in compiled.asm["ptx"]) == SUPPORTED
print("ok")
"""


@pytest.mark.parametrize("gated", [True, False])
def test_the_grouped_kernel_compiles_for_sm90_as_a_programmatic_launch(gated: bool) -> None:
    """Compiled for sm_90 on the CPU (ptxas, no GPU) as CUDA builds it there: fragment words,
    the PTX decode, waiting for the launch before it and releasing the next after the K loop
    (``kernelbay.triton_pdl``); gate/up (bf16 out) and down (weighted, float32 out). In a
    child process without ``TRITON_INTERPRET``, which this folder's tests set."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SM90, "gated" if gated else "down"],
                          env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode and "no ptxas here" in proc.stderr:  # compile_for_cuda's skip, raised
        pytest.skip(proc.stderr[-300:])
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr[-3000:]
