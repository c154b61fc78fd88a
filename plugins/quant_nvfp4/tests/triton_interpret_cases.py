"""``nvfp4-triton`` in Triton's interpreter on CPU against the reference. Not collected on
its own: ``test_nvfp4_triton.test_interpreter_cases`` runs this file in a child pytest with
``TRITON_INTERPRET=1`` set before triton is imported, so no other test sees the setting.
Tiny ragged shapes: K a multiple of 16 but not of the K tile, N ragged, M = 1, 3, 17."""

from __future__ import annotations

import os

import pytest
import torch
from kernelbay.formats import dequantize_nvfp4
from kernelbay.requests import LinearRequest
from kernelbay_quant_nvfp4.linear_triton import Nvfp4TritonLinear
from kernelbay_quant_nvfp4.schemes import nvfp4_scheme
from kernelbay_quant_nvfp4.triton_configs import KernelConfig
from nvfp4_triton_helpers import (
    check_close,
    edge_scales,
    make_layer,
    nvfp4_weights,
    run_on,
)

W4A16 = nvfp4_scheme("modelopt", w4a4=False)


@pytest.fixture(autouse=True)
def interpreting() -> None:
    """These cases mean nothing without the interpreter."""
    assert os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "k"), [(40, 272), (17, 48), (33, 96), (32, 384)])
@pytest.mark.parametrize("bias", [False, True])
def test_interpreter_matches_reference(dtype: torch.dtype, n: int, k: int,
                                       bias: bool) -> None:
    gen = torch.Generator().manual_seed(n + k + bias)
    tensors = nvfp4_weights(n, k, gen)
    edge_scales(tensors)
    if bias:
        tensors["bias"] = torch.randn(n, generator=gen).to(dtype)
    method = Nvfp4TritonLinear(LinearRequest(k, n, W4A16, str(dtype)[6:], bias))
    layer = make_layer(method, tensors)
    w = dequantize_nvfp4(tensors["weight"], tensors["weight_scale"], tensors["weight_scale_2"])
    for m in (1, 3, 17):
        x = torch.randn(m, k, generator=gen).to(dtype)
        check_close(method.apply(layer, x), x, w, tensors.get("bias"))
    x3 = torch.randn(2, 3, k, generator=gen).to(dtype)
    got = method.apply(layer, x3)
    assert got.shape == (2, 3, n)
    check_close(got.reshape(6, n), x3.reshape(6, k), w, tensors.get("bias"))
    assert torch.equal(method.dequantized_weight(layer), w.to(dtype))


@pytest.mark.parametrize("config", [KernelConfig("split3", "fused", 16, 16, 64, 3, 4, 1),
                                    KernelConfig("nosplit", "fused", 32, 32, 64, 1, 4, 1),
                                    KernelConfig("pairs-split3", "pairs", 16, 16, 64, 3, 4, 1),
                                    KernelConfig("pairs", "pairs", 32, 32, 128, 1, 4, 1),
                                    KernelConfig("repacked-split3", "repacked", 16, 16, 64, 3,
                                                 4, 1),
                                    KernelConfig("repacked", "repacked", 32, 32, 128, 1, 4, 1),
                                    KernelConfig("fragment-split3", "fragment", 16, 16, 64, 3,
                                                 4, 1),
                                    KernelConfig("fragment", "fragment", 32, 32, 128, 1, 4, 1),
                                    KernelConfig("tiles-split3", "tiles", 16, 16, 64, 3, 4, 1),
                                    KernelConfig("tiles-ragged", "tiles", 32, 32, 256, 1, 4, 1),
                                    KernelConfig("dequant", "dequant")], ids=str)
def test_interpreter_every_path(config: KernelConfig) -> None:
    """Split-K with a K not a multiple of the tile (272 = 4.25 tiles of 64), no split, the
    word decode (elements k and k + 4 paired, activations permuted to match), the tiles
    layout (whole 16-row tiles and 128-element chunks: 384 = 1.5 tiles of 256) and the
    dequantize-then-F.linear path, all against the reference."""
    from kernelbay_quant_nvfp4.triton_kernels import dequantize_nvfp4_triton

    gen = torch.Generator().manual_seed(7)
    k = {"fragment": 288, "tiles": 384}.get(config.path, 272)  # K a multiple of 32 / 128
    n = 32 if config.path == "tiles" else 24
    tensors = nvfp4_weights(n, k, gen)
    edge_scales(tensors)
    w = dequantize_nvfp4(tensors["weight"], tensors["weight_scale"], tensors["weight_scale_2"])
    assert torch.equal(dequantize_nvfp4_triton(tensors["weight"], tensors["weight_scale"],
                                               tensors["weight_scale_2"], torch.float32), w)
    bias = torch.randn(n, generator=gen).to(torch.float16)
    for m in (1, 17):
        x = torch.randn(m, k, generator=gen).to(torch.float16)
        got = run_on(config, x, tensors, bias)
        check_close(got, x, w, bias)


@pytest.mark.parametrize(("n", "k"), [(200, 300), (128, 256), (40, 16)])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_block_pads_inside_the_method(n: int, k: int, bias: bool) -> None:
    """FP8_PB_WO with N, K not multiples of 128: the method pads after loading; callers see
    [M, N] outputs and the [N, K] weight, equal to the core reference (torch-fp8-dequant's
    math: kernelbay.formats.dequantize_fp8_per_block, then a matmul)."""
    from kernelbay.formats import dequantize_fp8_per_block, quantize_fp8_per_block
    from kernelbay.requests import QuantScheme
    from kernelbay_quant_nvfp4.fp8_block import Fp8BlockTritonLinear

    scheme = QuantScheme("fp8-block", "float8_e4m3fn", (128, 128), "float32", False, None,
                         "modelopt")
    gen = torch.Generator().manual_seed(n + k)
    q, s = quantize_fp8_per_block(torch.randn(n, k, generator=gen) * 3)
    s[0, -1] = 0.0  # a zero tile scale
    method = Fp8BlockTritonLinear(LinearRequest(k, n, scheme, "bfloat16", bias))
    specs = method.tensor_specs()
    assert specs["weight"].shape == (n, k) and specs["weight_scale"].shape == tuple(s.shape)
    layer = torch.nn.Module()
    method.create_weights(layer)
    layer.weight.data.copy_(q)
    layer.weight_scale.data.copy_(s)
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    if bias:
        layer.bias.data.copy_(b)
    method.process_weights_after_loading(layer)
    assert layer.weight.shape == (-(-n // 128) * 128, -(-k // 128) * 128)
    w = dequantize_fp8_per_block(q, s)
    for m in (1, 3, 17):
        x = torch.randn(m, k, generator=gen).bfloat16()
        check_close(method.apply(layer, x), x, w, b)
    assert torch.equal(method.dequantized_weight(layer), w.bfloat16())


HALFWORD = [KernelConfig("hw-split", "fused", 16, 16, 64, 3),
            KernelConfig("pr", "repacked", 32, 32, 128, 1),
            KernelConfig("pr-split", "repacked", 16, 16, 64, 3),
            KernelConfig("pf", "fragment", 32, 32, 128, 1),
            KernelConfig("pf-split", "fragment", 16, 32, 64, 3),
            KernelConfig("hw", "fused", 32, 32, 128, 1),
            KernelConfig("hw-even", "fused", 16, 32, 64, 2)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("config", HALFWORD, ids=str)
@pytest.mark.parametrize("bias", [False, True])
def test_halfword_variant(config: KernelConfig, dtype: torch.dtype, bias: bool) -> None:
    """The halfword kernel (portable decode; the PTX one runs on CUDA only): K = 272 (not a
    multiple of the tile) and K = 256 (whole tiles, unmasked loop), ragged N and M, edge block
    scales, rows from 1e-6 to 1e4 and a zero row."""

    # 320: five whole tiles of 64 in splits of 2, 2 and 1; fragment order: K a multiple of 32
    for k in (288 if config.path == "fragment" else 272, 256, 320):
        gen = torch.Generator().manual_seed(13 + bias + k)
        tensors = nvfp4_weights(40, k, gen)
        edge_scales(tensors)
        w = dequantize_nvfp4(tensors["weight"], tensors["weight_scale"],
                             tensors["weight_scale_2"])
        b = torch.randn(40, generator=gen).to(dtype) if bias else None
        for m in (1, 17):
            top = 4 if dtype == torch.bfloat16 else 1
            x = torch.randn(m, k, generator=gen) * torch.logspace(-6, top, m)[:, None]
            x[m // 2] = 0.0
            x = x.to(dtype)
            got = run_on(config, x, tensors, b)
            check_close(got, x, w, b)


@pytest.mark.parametrize("config", [*HALFWORD[:2], HALFWORD[3]], ids=str)
def test_halfword_decodes_every_code_and_scale(config: KernelConfig) -> None:
    """Every E2M1 code under every finite E4M3 block scale (signed zeros, subnormal and
    largest scales), one product per output: the reference rounded to bf16, bit for bit."""
    from nvfp4_triton_helpers import every_code_and_scale

    tensors, eye = every_code_and_scale()
    w = dequantize_nvfp4(tensors["weight"], tensors["weight_scale"], tensors["weight_scale_2"])
    got = run_on(config, eye, tensors, None)
    assert torch.equal(got, w.T.to(torch.bfloat16))


@pytest.mark.parametrize(("row_tiles", "rows", "chunks", "ctas", "m", "n"),
                         [(7, 64, 5, 9, 3, 420), (3, 128, 4, 4, 17, 384), (2, 64, 1, 5, 1, 128),
                          (4, 64, 9, 3, 5, 250)])
@pytest.mark.parametrize("bias", [False, True])
def test_stream_k_segments_sum_to_the_product(row_tiles: int, rows: int, chunks: int,
                                              ctas: int, m: int, n: int, bias: bool) -> None:
    """The stream-K plan and fix-up: the (row tile, chunk) units cut into equal CTA ranges,
    each CTA's segments written as the wgmma kernel writes them (partial[p, s, token, row of
    the tile], s = its tile minus the tile of its first unit), and ``sum_stream_segments``
    adds every tile's segments in CTA order: the product per chunk summed over K, bias added,
    rows past N dropped. Tiles shared by up to four CTAs, CTAs with several tiles, a CTA per
    chunk."""
    from kernelbay_quant_nvfp4.cuda_wgmma import stream_plan
    from kernelbay_quant_nvfp4.triton_kernels import sum_stream_segments

    gen = torch.Generator().manual_seed(row_tiles * 100 + chunks * 10 + ctas)
    per_chunk = torch.randn(row_tiles, chunks, m, rows, generator=gen)   # tile, chunk: [m, rows]
    p, segments = stream_plan(row_tiles, chunks, ctas)
    units = row_tiles * chunks
    part = torch.full((p, segments, m, rows), float("nan"))
    for q in range(p):
        first, end = q * units // p, (q + 1) * units // p
        for u in range(first, end):
            r, c = divmod(u, chunks)
            s = r - first // chunks
            if u == first or c == 0:
                part[q, s] = 0.0
            part[q, s] += per_chunk[r, c]
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    out = torch.empty(m, n, dtype=torch.bfloat16)
    sum_stream_segments(part, b, out, chunks)
    want = per_chunk.sum(dim=1).permute(1, 0, 2).reshape(m, row_tiles * rows)[:, :n]
    if b is not None:
        want = want + b.float()
    torch.testing.assert_close(out.float(), want.bfloat16().float(), rtol=2**-7, atol=1e-5)


def _recorded_launches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, bool]]:
    """(SPLIT, FINISH) of every grouped-kernel launch from now on."""
    from kernelbay_quant_nvfp4 import triton_grouped

    real = triton_grouped.grouped_kernel
    seen: list[tuple[int, bool]] = []

    class Recording:
        def __getitem__(self, grid):  # type: ignore[no-untyped-def]
            def launch(*args, **kwargs):  # type: ignore[no-untyped-def]
                seen.append((kwargs.get("SPLIT", 1), kwargs.get("FINISH", False)))
                return real()[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(triton_grouped, "grouped_kernel", Recording)
    return seen


UNSPLIT = [(1, False), (1, False)]  # gate/up, down
SPLIT_IN_TWO = [(2, False), (2, True), (1, False)]  # gate/up splits, finish, down


@pytest.mark.parametrize("experts, hidden, inter, tokens, top_k, layouts, launches", [
    # 16-row blocks; K = 48 is not whole 32-element groups, so gate/up keep the K order
    (3, 48, 32, 7, 2, ("repacked", "fragment"), UNSPLIT),
    (3, 48, 32, 30, 2, ("repacked", "fragment"), UNSPLIT),  # 32-row blocks (20 per expert)
    (4, 256, 128, 5, 3, ("tiles", "tiles"), UNSPLIT),
    (4, 48, 32, 0, 2, ("repacked", "fragment"), []),  # no tokens: nothing launched
    # I = 48: gate/up paired in turns of 64 rows, padded; ragged down K
    (3, 64, 48, 6, 2, ("fragment", "repacked"), UNSPLIT),
    # one 128-row tile, four blocks, four K tiles: the gate/up GEMM splits K in two
    (4, 1024, 64, 3, 2, ("tiles", "fragment"), SPLIT_IN_TWO),
    # one routed slot (top-1 at one token)
    (4, 1024, 64, 1, 1, ("tiles", "fragment"), SPLIT_IN_TWO),
])
def test_moe_triton_matches_emulation(monkeypatch: pytest.MonkeyPatch, experts: int,
                                      hidden: int, inter: int, tokens: int, top_k: int,
                                      layouts: tuple[str, str],
                                      launches: list[tuple[int, bool]]) -> None:
    """nvfp4-moe-triton (grouped Triton GEMMs over the blocks of the routing) == the
    emulation, across the stored layouts, split and unsplit (the launches are recorded)."""
    from moe_helpers import check_moe_triton

    seen = _recorded_launches(monkeypatch)
    check_moe_triton("cpu", experts=experts, hidden=hidden, inter=inter, tokens=tokens,
                     top_k=top_k, layouts=layouts)
    assert seen == launches


def test_gate_up_splits_rule() -> None:
    from kernelbay_quant_nvfp4.triton_grouped import gate_up_splits

    assert gate_up_splits(4, 4, 132, 2) == 2
    assert gate_up_splits(4, 4, 132, 0) == 1
    assert gate_up_splits(300, 28, 132, 2) == 1
    assert gate_up_splits(32, 28, 132, 2) == 8


@pytest.mark.parametrize("hidden, launches", [(80, UNSPLIT), (304, SPLIT_IN_TWO)])
def test_moe_triton_reads_the_checkpoint_layout(monkeypatch: pytest.MonkeyPatch, hidden: int,
                                                launches: list[tuple[int, bool]]) -> None:
    """With a halfword table every projection keeps the checkpoint's bytes (read as int16
    halfwords, 64-element K tiles, no operand swap); the grouped kernels read them too, also
    split over a ragged K (304: five tiles, the last split shorter)."""
    from kernelbay_quant_nvfp4.linear_triton import Nvfp4TritonLinear as Linear
    from moe_helpers import check_moe_triton

    table = ((1 << 62, KernelConfig("hw", "fused", 32, 32, 128, 1)),)
    monkeypatch.setattr(Linear, "configs", table)
    seen = _recorded_launches(monkeypatch)
    check_moe_triton("cpu", experts=3, hidden=hidden, inter=48, tokens=2, top_k=2,
                     layouts=("checkpoint", "checkpoint"))
    assert seen == launches
