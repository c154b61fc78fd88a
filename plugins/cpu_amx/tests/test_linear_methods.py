"""The linear methods: what they accept (with reasons), loading, orientation, and results
against the one FP8 reference."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from cpu_amx_helpers import (
    KERNEL_FLAGS,
    assert_within_bound,
    make_scale,
    random_codes,
    reference,
)
from kernelbay import BackendKind, LinearRequest, QuantScheme, Registry, parse_device, select
from kernelbay.formats.fp8 import quantize_fp8_per_block, quantize_fp8_per_tensor
from kernelbay_cpu_amx.linear import CpuBf16Avx512Linear, CpuFp8Avx512Linear

AVX = parse_device("cpu+avx512_bf16")
AMX = parse_device("cpu+amx")
BLOCK = QuantScheme("fp8-block", "float8_e4m3fn", (128, 128), "float32", dialect="hf-fp8")
TENSOR = QuantScheme("fp8", "float8_e4m3fn", None, "float32", activation="fp8-static",
                     dialect="modelopt")
needs_kernels = pytest.mark.cpu_isa(*KERNEL_FLAGS)


def block(bn: int, bk: int, **options: str) -> QuantScheme:
    return QuantScheme("fp8-block", "float8_e4m3fn", (bn, bk), "float32", dialect="hf-fp8",
                       options=tuple(sorted(options.items())))


# -- can_implement ---------------------------------------------------------------------------

def test_accepts_fp8_on_avx512_bf16_and_amx_cpus() -> None:
    request = LinearRequest(4096, 14336, BLOCK, "bfloat16")
    for device in (AVX, AMX):
        verdict = CpuFp8Avx512Linear.can_implement(request, device)
        assert verdict.accepted, verdict.reason
    assert "no AMX" in CpuFp8Avx512Linear.can_implement(request, AVX).describe()
    assert "AMX tiles" in CpuFp8Avx512Linear.can_implement(request, AMX).describe()
    per_tensor = CpuFp8Avx512Linear.can_implement(LinearRequest(4096, 4096, TENSOR), AVX)
    assert per_tensor.accepted and "fp8-static not applied" in per_tensor.describe()
    fp32 = CpuFp8Avx512Linear.can_implement(LinearRequest(4096, 4096, BLOCK, "float32"), AVX)
    assert fp32.accepted and "rounded to bf16" in fp32.describe()


@pytest.mark.parametrize("request_, device, reason", [
    (LinearRequest(4096, 4096, BLOCK), parse_device("sm_90"),
     "runs on x86 CPUs, device platform is 'cuda'"),
    (LinearRequest(4096, 4096, BLOCK), parse_device("cpu"),
     "needs CPU flags ['avx512f', 'avx512bw', 'avx512vl', 'avx512_bf16'], device lacks "
     "['avx512f', 'avx512bw', 'avx512vl', 'avx512_bf16']"),
    (LinearRequest(4096, 4096, BLOCK), parse_device("cpu+avx512"),
     "device lacks ['avx512_bf16']"),
    (LinearRequest(4096, 4100, BLOCK), AVX, "N=4100 is not a multiple of 32"),
    (LinearRequest(4160, 4096, BLOCK), AVX, "K=4160 is not a multiple of the K block 128"),
    (LinearRequest(4096, 4096, block(128, 48)), AVX,
     "needs a K block that is a multiple of 32, group_shape is (128, 48)"),
    (LinearRequest(4096, 4096, block(8, 128)), AVX,
     "needs 1 or a multiple of 16 rows of N per scale, group_shape is (8, 128)"),
    (LinearRequest(4100, 4096, TENSOR), AVX, "K=4100 is not a multiple of 32"),
    (LinearRequest(4096, 4096, BLOCK, "float16"), AVX,
     "needs activation dtype in ('bfloat16', 'float32'), request has 'float16'"),
    (LinearRequest(4096, 4096, QuantScheme("fp8-block", "float8_e4m3fn", (128, 128),
                                           activation="mxfp8-dynamic")), AVX,
     "needs activation scheme in (None, 'fp8-static', 'fp8-dynamic') (W8A16), scheme has "
     "'mxfp8-dynamic'"),
    (LinearRequest(4096, 4096, block(128, 128, weight_layout="nkk")), AVX,
     "needs scheme option weight_layout in ('nk', 'kn'), got 'nkk'"),
])
def test_rejections_name_both_sides(request_: LinearRequest, device: object, reason: str) -> None:
    verdict = CpuFp8Avx512Linear.can_implement(request_, device)  # type: ignore[arg-type]
    assert not verdict.accepted
    assert reason in verdict.reason
    assert verdict.applicable


def test_other_schemes_are_not_applicable() -> None:
    for scheme in (QuantScheme("nvfp4", "e2m1", (1, 16), "float8_e4m3fn", True),
                   QuantScheme("unquantized")):
        verdict = CpuFp8Avx512Linear.can_implement(LinearRequest(4096, 4096, scheme), AVX)
        assert not verdict.accepted and not verdict.applicable
        assert scheme.name in verdict.reason or "unquantized" in verdict.reason
    verdict = CpuBf16Avx512Linear.can_implement(LinearRequest(4096, 4096, BLOCK), AVX)
    assert not verdict.accepted and not verdict.applicable
    # Routed experts are cpu-fp8-moe's: the dense methods pass them over without a warning.
    for cls, scheme in ((CpuFp8Avx512Linear, BLOCK), (CpuBf16Avx512Linear, QuantScheme(
            "unquantized"))):
        verdict = cls.can_implement(LinearRequest(4096, 4096, scheme, num_experts=8), AVX)
        assert not verdict.accepted and not verdict.applicable
        assert "handles dense layers only, request stacks 8 experts" in verdict.reason


def test_bf16_method_verdicts() -> None:
    ok = CpuBf16Avx512Linear.can_implement(LinearRequest(4096, 4096), AVX)
    assert ok.accepted
    fp32 = CpuBf16Avx512Linear.can_implement(LinearRequest(4096, 4096,
                                                           activation_dtype="float32"), AVX)
    assert "needs activation dtype 'bfloat16'" in fp32.reason
    odd = CpuBf16Avx512Linear.can_implement(LinearRequest(100, 4096), AVX)
    assert odd.reason == "K=100 is not a multiple of 32"


def test_selection_prefers_this_plugin_over_the_reference(registry: Registry) -> None:
    chosen = select(BackendKind.LINEAR, LinearRequest(4096, 4096, BLOCK), AVX,
                    registry=registry)
    assert chosen.name == "cpu-fp8-avx512"
    ragged = select(BackendKind.LINEAR, LinearRequest(4096, 4100, BLOCK), AVX,
                    registry=registry)
    assert ragged.name == "torch-fp8-dequant"
    assert "N=4100 is not a multiple of 32" in ragged.render()
    gpu = select(BackendKind.LINEAR, LinearRequest(4096, 4096, BLOCK), parse_device("sm_90"),
                 registry=registry)
    assert gpu.name == "torch-fp8-dequant"


# -- loading and apply ------------------------------------------------------------------------

def load(method: CpuFp8Avx512Linear | CpuBf16Avx512Linear,
         tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """Create the parameters, copy the checkpoint tensors in (checking specs), post-process."""
    layer = torch.nn.Module()
    method.create_weights(layer)
    for name, spec in method.tensor_specs().items():
        value = tensors[name]
        assert tuple(value.shape) == spec.shape, (name, value.shape, spec.shape)
        getattr(layer, name).data.copy_(value)
    method.process_weights_after_loading(layer)
    return layer


@needs_kernels
@pytest.mark.parametrize("group", [None, (128, 128), (1, 128), (32, 64)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fp8_layer_matches_reference(ext: ModuleType, group: tuple[int, int] | None,
                                     dtype: str) -> None:
    n, k = 192, 256
    gen = torch.Generator().manual_seed(11)
    q = random_codes(n, k, gen)
    scale = make_scale(n, k, group, gen)
    bias = torch.randn(n, generator=gen).to(getattr(torch, dtype))
    scheme = TENSOR if group is None else block(*group)
    method = CpuFp8Avx512Linear(LinearRequest(k, n, scheme, dtype, bias=True))
    tensors = {"weight": q, "weight_scale": scale, "bias": bias}
    if group is None:
        tensors["input_scale"] = torch.tensor(0.5)  # fp8-static: read, unused (W8A16)
    layer = load(method, tensors)
    assert layer.weight.dtype == torch.uint8 and layer.weight.shape == (n // 32, k // 2, 64)
    for m in (1, 5, 17, 64, 100):
        x = torch.randn(m, k, generator=gen).to(getattr(torch, dtype))
        out = method.apply(layer, x)
        assert out.dtype == x.dtype
        y, mag = reference(x, q, scale, group, bias.float())
        assert_within_bound(out, y, mag, k, 1 if group is None else k // group[1])


@needs_kernels
def test_quantized_dense_weights_track_the_dense_layer(ext: ModuleType) -> None:
    """End to end from a dense weight: quantize by the reference, run, compare to the dense
    F.linear within FP8's own quantization error (3 mantissa bits)."""
    gen = torch.Generator().manual_seed(12)
    n, k = 256, 512
    dense = torch.randn(n, k, generator=gen) * k**-0.5
    x = torch.randn(9, k, generator=gen).to(torch.bfloat16)
    exact = F.linear(x.float(), dense)
    for scheme, (q, s) in ((BLOCK, quantize_fp8_per_block(dense, (128, 128))),
                           (TENSOR, quantize_fp8_per_tensor(dense))):
        method = CpuFp8Avx512Linear(LinearRequest(k, n, scheme))
        tensors = {"weight": q, "weight_scale": s}
        if scheme is TENSOR:
            tensors["input_scale"] = torch.tensor(1.0)
        out = method.apply(load(method, tensors), x).float()
        rel = (out - exact).norm() / exact.norm()
        assert rel < 2**-4, (scheme.name, rel.item())


@needs_kernels
def test_row_parallel_bias_only_on_rank_zero(ext: ModuleType) -> None:
    n, k = 64, 128
    gen = torch.Generator().manual_seed(13)
    q, s = random_codes(n, k, gen), make_scale(n, k, (128, 128), gen)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    x = torch.randn(3, k, generator=gen).to(torch.bfloat16)
    for rank, with_bias in ((0, True), (1, False)):
        method = CpuFp8Avx512Linear(LinearRequest(k, n, BLOCK, bias=True, parallel="row",
                                                  tp_rank=rank, tp_size=2))
        layer = load(method, {"weight": q, "weight_scale": s, "bias": bias})
        # Partial sums are all-reduced afterwards: only rank 0 adds the bias.
        y, mag = reference(x, q, s, (128, 128), bias.float() if with_bias else None)
        assert_within_bound(method.apply(layer, x), y, mag, k, 1)


# -- orientation ------------------------------------------------------------------------------

@needs_kernels
@pytest.mark.parametrize("n, k, group, declared", [
    (64, 256, (128, 128), "kn"),    # declared by the format, non-square
    (64, 256, (128, 128), "nk"),    # not declared: the [K, N] shape gives it away
    (128, 128, (1, 128), "nk"),     # square: the per-row scale grid [1, 128] gives it away
    (128, 128, (128, 128), "kn"),   # square, square blocks: only the declaration can tell
])
def test_transposed_exporter_is_canonicalised(ext: ModuleType, n: int, k: int,
                                              group: tuple[int, int], declared: str) -> None:
    gen = torch.Generator().manual_seed(14)
    q, s = random_codes(n, k, gen), make_scale(n, k, group, gen)
    options = {"weight_layout": "kn"} if declared == "kn" else {}
    method = CpuFp8Avx512Linear(LinearRequest(k, n, block(*group, **options)))
    specs = method.tensor_specs()
    if declared == "kn":
        assert specs["weight"].shape == (k, n)
    layer = torch.nn.Module()
    method.create_weights(layer)
    # The exporter wrote W^T and the transposed scale grid.
    layer.weight = torch.nn.Parameter(q.t().contiguous(), requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(s.t().contiguous(), requires_grad=False)
    method.process_weights_after_loading(layer)
    x = torch.randn(5, k, generator=gen).to(torch.bfloat16)
    y, mag = reference(x, q, s, group, None)
    assert_within_bound(method.apply(layer, x), y, mag, k, k // group[1])


def test_kn_layout_flips_the_shard_dim() -> None:
    request = LinearRequest(512, 256, block(128, 128, weight_layout="kn"), parallel="column",
                            tp_size=2)
    specs = CpuFp8Avx512Linear(request).tensor_specs()
    assert specs["weight"].shape == (512, 256) and specs["weight"].shard_dim == 1
    assert specs["weight_scale"].shape == (4, 2) and specs["weight_scale"].shard_dim == 1


def test_shapes_that_fit_no_orientation_raise() -> None:
    method = CpuFp8Avx512Linear(LinearRequest(256, 64, BLOCK))
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.zeros(64, 128).to(torch.float8_e4m3fn),
                                      requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(torch.ones(1, 2), requires_grad=False)
    with pytest.raises(ValueError, match=r"weight has shape \[64, 128\], expected \[N, K\] = "
                                         r"\[64, 256\] or \[K, N\] = \[256, 64\]"):
        method.process_weights_after_loading(layer)
    layer.weight = torch.nn.Parameter(torch.zeros(64, 256).to(torch.float8_e4m3fn),
                                      requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(torch.ones(3, 3), requires_grad=False)
    with pytest.raises(ValueError, match=r"weight_scale has shape \(3, 3\).*needs \(1, 2\)"):
        method.process_weights_after_loading(layer)


# -- bf16 through the same kernels ------------------------------------------------------------

@needs_kernels
def test_bf16_layer_matches_f_linear(ext: ModuleType) -> None:
    gen = torch.Generator().manual_seed(15)
    n, k = 160, 256
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    method = CpuBf16Avx512Linear(LinearRequest(k, n, bias=True))
    layer = load(method, {"weight": w, "bias": bias})
    for m in (1, 3, 16, 33, 100):
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        y = x.double() @ w.double().t() + bias.double()
        mag = x.double().abs() @ w.double().abs().t() + bias.double().abs()
        assert_within_bound(method.apply(layer, x), y, mag, k, 1)


# -- tensor parallel ----------------------------------------------------------------------------

@needs_kernels
@pytest.mark.parametrize("n_total, tp_size, replicated", [(256, 2, False), (192, 2, True),
                                                          (384, 4, True)])
def test_column_parallel_shards_match_the_whole_layer(ext: ModuleType, n_total: int,
                                                      tp_size: int, replicated: bool) -> None:
    """Each rank's output equals its slice of the unsharded layer's; when a rank's rows are
    not whole 128-row scale blocks, it reads the whole scale grid and picks its rows."""
    from kernelbay_cpu_amx.linear import replicated_block_scales

    k = 256
    gen = torch.Generator().manual_seed(16)
    q, s = random_codes(n_total, k, gen), make_scale(n_total, k, (128, 128), gen)
    x = torch.randn(7, k, generator=gen).to(torch.bfloat16)
    y, mag = reference(x, q, s, (128, 128), None)
    n = n_total // tp_size
    for rank in range(tp_size):
        request = LinearRequest(k, n, BLOCK, parallel="column", tp_rank=rank, tp_size=tp_size)
        assert replicated_block_scales(request) is replicated
        method = CpuFp8Avx512Linear(request)
        spec = method.tensor_specs()["weight_scale"]
        rows = slice(rank * n, (rank + 1) * n)
        if replicated:
            assert spec.shard_dim is None and spec.shape == (-(-n_total // 128), 2)
            scale = s
        else:
            assert spec.shard_dim == 0 and spec.shape == (n // 128, 2)
            scale = s[rank * n // 128:(rank + 1) * n // 128]
        layer = load(method, {"weight": q[rows], "weight_scale": scale})
        assert_within_bound(method.apply(layer, x), y[:, rows], mag[:, rows], k, 2)


def test_row_parallel_needs_whole_k_blocks() -> None:
    request = LinearRequest(4096 // 3 // 32 * 32, 4096, BLOCK, parallel="row", tp_size=3)
    verdict = CpuFp8Avx512Linear.can_implement(request, AVX)
    assert not verdict.accepted
    assert verdict.reason == "K=1344 is not a multiple of the K block 128"
