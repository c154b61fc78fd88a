"""The Triton methods (``mxfp4-triton``, ``mxfp4-triton-cuda``, ``mxfp4-moe-triton``) against
the emulation methods, where they are offered, how forcing reaches them, and the MoE backend
variable. Kernels run under the interpreter without a GPU (tiny shapes)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from kernelbay.device import parse_device
from kernelbay.errors import ForcedBackendError
from kernelbay.formats import dequantize_mx, quantize_mx
from kernelbay.kinds import BackendKind
from kernelbay.plugins import Registry
from kernelbay.policy import Policy
from kernelbay.requests import LinearRequest, QuantScheme
from kernelbay.select import select
from kernelbay_quant_mxfp4_rocm import moe_backend
from kernelbay_quant_mxfp4_rocm.emulation import Mxfp4EmulationLinear
from kernelbay_quant_mxfp4_rocm.moe import Mxfp4MoEEmulation
from kernelbay_quant_mxfp4_rocm.triton_linear import (
    CUDA_FORCE_NOTE,
    Mxfp4TritonCudaLinear,
    Mxfp4TritonLinear,
)
from kernelbay_quant_mxfp4_rocm.triton_moe import Mxfp4MoETriton
from test_mxfp4_moe import _load, _request, _routing, _weights

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":  # the kernels run under Triton's interpreter (conftest)
    pytestmark = pytest.mark.triton_interpreter
CPU, MI355, MI300, H200 = (parse_device(d) for d in ("cpu", "gfx950", "gfx942", "sm_90"))


def mx(activation: str | None = None, mode: str = "even") -> QuantScheme:
    return QuantScheme("mxfp4", "e2m1", (1, 32), "e8m0", False, activation, "quark",
                       (("scale_mode", mode),))


@pytest.fixture(autouse=True)
def _fresh_choice(monkeypatch: pytest.MonkeyPatch) -> Any:
    for var in (moe_backend.BACKEND_VARIABLE, moe_backend.DEPRECATED_VARIABLE):
        monkeypatch.delenv(var, raising=False)
    moe_backend.reset_choice()
    yield
    moe_backend.reset_choice()


def _dense_layer(method: Mxfp4EmulationLinear, packed: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.nn.Module:
    layer = torch.nn.Module()
    method.create_weights(layer)
    layer.weight.data.copy_(packed)
    layer.weight_scale.data.copy_(scales)
    if bias is not None:
        layer.bias.data.copy_(bias)
    method.process_weights_after_loading(layer)
    return layer.to(DEVICE)


@pytest.mark.parametrize("activation", [None, "mxfp4-dynamic", "mxfp8-dynamic"])
@pytest.mark.parametrize("rule", ["even", "rceil"])
@pytest.mark.parametrize("repack", [False, True])
def test_dense_matches_the_emulation(activation: str | None, rule: str, repack: bool,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The method against the emulation, with the weight as loaded and (``repack``: as where
    the PTX decode runs) stored in the repacked word layout."""
    from kernelbay_quant_mxfp4_rocm import triton_gemm

    if repack:  # storage only: the kernels keep the portable decode under the interpreter
        monkeypatch.setattr(triton_gemm, "_asm_target", lambda: True)
    n, k = 40, 96
    g = torch.Generator().manual_seed(41)
    packed, scales = quantize_mx(torch.randn(n, k, generator=g), "e2m1", "even")
    bias = torch.randn(n, generator=g).bfloat16()
    request = LinearRequest(k, n, mx(activation, rule), "bfloat16", True)
    triton_method = Mxfp4TritonLinear(request)
    emulation = Mxfp4EmulationLinear(request)
    layer_t = _dense_layer(triton_method, packed, scales, bias)
    layer_e = _dense_layer(emulation, packed, scales, bias)
    want_dtype = torch.int32 if repack or DEVICE == "cuda" else torch.uint8
    assert layer_t.weight.dtype == want_dtype
    x = torch.randn(2, 3, k, generator=g).bfloat16().to(DEVICE)  # 3-D input
    y = triton_method.apply(layer_t, x)
    want = emulation.apply(layer_e, x)
    assert y.shape == want.shape == (2, 3, n) and y.dtype == torch.bfloat16
    # the same exact products summed in another order, then rounded to bf16: one bf16 ulp
    torch.testing.assert_close(y.float(), want.float(), rtol=2**-7, atol=1e-5)
    assert torch.equal(triton_method.dequantized_weight(layer_t).cpu(),
                       dequantize_mx(packed, scales, "e2m1").bfloat16())


@pytest.mark.parametrize("activation", [None, "mxfp4-dynamic", "mxfp8-dynamic"])
def test_moe_matches_the_emulation(activation: str | None) -> None:
    experts, hidden, inter, tokens = 3, 64, 64, 5
    weights = _weights(experts, hidden, inter, 2)
    request = _request(mx(activation), experts, hidden, inter)
    triton_method, emulation = Mxfp4MoETriton(request), Mxfp4MoEEmulation(request)
    layer_t, layer_e = _load(triton_method, weights).to(DEVICE), _load(emulation, weights)
    ids, topk = _routing(tokens, experts, 2, 3)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(4)).bfloat16()
    y = triton_method.apply_moe(layer_t, x.to(DEVICE), ids.to(DEVICE), topk.to(DEVICE)).cpu()
    want = emulation.apply_moe(layer_e, x, ids, topk)
    assert y.dtype == want.dtype == torch.bfloat16
    if activation is None:
        # the emulation rounds gate/up, SiLU and each expert's output to bf16 (as TorchMoE);
        # the kernels keep float32 until h and the sum: both against float64 on the same
        # dequantized weights, the kernels at least as close
        exact = _float64_moe(weights, x, ids, topk)
        errors = [float((v.double() - exact).norm() / exact.norm()) for v in (y, want)]
        assert errors[0] < 2**-8 and errors[0] <= errors[1] * 1.25, errors
        return
    # float32 sums in another order; with MX activations a product that lands on a rounding
    # boundary of the down projection's input may take the neighbouring code: compare norms
    err = (y.float() - want.float()).norm() / want.float().norm()
    assert err < 2**-8, err.item()


def _float64_moe(weights: dict[tuple[int, str], torch.Tensor], x: torch.Tensor,
                 ids: torch.Tensor, topk: torch.Tensor) -> torch.Tensor:
    """Weight-only SwiGLU experts per token in float64 on the MXFP4-dequantized weights."""
    dq = {key: dequantize_mx(*quantize_mx(w, "e2m1", "even"), "e2m1").double()
          for key, w in weights.items()}
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e, row = int(ids[t, j]), x[t].double()
            h = torch.nn.functional.silu(row @ dq[(e, "gate_proj")].T) * (
                row @ dq[(e, "up_proj")].T)
            out[t] += float(topk[t, j]) * (h @ dq[(e, "down_proj")].T)
    return out


def test_where_the_methods_accept() -> None:
    dense = LinearRequest(64, 64, mx("mxfp4-dynamic"), "bfloat16")
    v950 = Mxfp4TritonLinear.can_implement(dense, MI355)
    assert v950.accepted and "gfx950 has native MX" in v950.describe()
    assert "quantized mxfp4-dynamic by Triton (scale rule even)" in v950.describe()
    assert "no native MX" in Mxfp4TritonLinear.can_implement(dense, MI300).describe()
    on_cuda = Mxfp4TritonLinear.can_implement(dense, H200)
    assert not on_cuda.accepted and on_cuda.reason == (
        "runs on ROCm gfx942/gfx950, device is cuda sm_90")
    cuda = Mxfp4TritonCudaLinear.can_implement(dense, H200)
    assert cuda.accepted and CUDA_FORCE_NOTE in cuda.describe()
    assert Mxfp4TritonCudaLinear.priority < Mxfp4EmulationLinear.priority
    assert "device is rocm gfx950" in Mxfp4TritonCudaLinear.can_implement(dense, MI355).reason
    fp16 = Mxfp4TritonLinear.can_implement(LinearRequest(64, 64, mx(), "float16"), MI355)
    assert not fp16.accepted and "needs bfloat16 activations" in fp16.reason
    assert "'float16'" in fp16.reason
    experts = _request(mx(), 4, 64, 64)
    assert not Mxfp4TritonLinear.can_implement(experts, MI355).applicable


def _registry() -> Registry:
    import importlib.metadata as metadata

    from kernelbay.plugins import ENTRY_POINT_GROUP

    reg = Registry(Policy(plugins=frozenset(["quant_mxfp4_rocm"])))
    (ep,) = [e for e in metadata.entry_points(group=ENTRY_POINT_GROUP)
             if e.name == "quant_mxfp4_rocm"]
    reg.load_entry_point(ep)
    return reg


def test_forcing_on_cuda() -> None:
    registry = _registry()
    dense = LinearRequest(64, 64, mx(), "bfloat16")
    plain = select(BackendKind.LINEAR, dense, H200, registry.policy, registry=registry)
    assert plain.backend.name == "mxfp4-emulation"
    forced = registry.policy.with_force(BackendKind.LINEAR, "mxfp4-triton-cuda")
    chosen = select(BackendKind.LINEAR, dense, H200, forced, registry=registry)
    assert chosen.backend.name == "mxfp4-triton-cuda"
    assert CUDA_FORCE_NOTE in chosen.verdict.describe()
    wrong = registry.policy.with_force(BackendKind.LINEAR, "mxfp4-triton")
    with pytest.raises(ForcedBackendError, match="runs on ROCm gfx942/gfx950, device is cuda"):
        select(BackendKind.LINEAR, dense, H200, wrong, registry=registry)
    home = select(BackendKind.LINEAR, dense, MI355, registry.policy, registry=registry)
    assert home.backend.name == "mxfp4-triton"


def test_moe_backend_variable(monkeypatch: pytest.MonkeyPatch,
                              caplog: pytest.LogCaptureFixture) -> None:
    experts = _request(mx("mxfp4-dynamic"), 4, 64, 64)
    default = Mxfp4MoETriton.can_implement(experts, MI355)
    assert default.accepted and "MoE backend 'auto' (from default)" in default.describe()
    assert not Mxfp4MoETriton.can_implement(experts, H200).accepted
    assert "(on CUDA only with KERNELBAY_MXFP4_MOE_BACKEND=triton)" in (
        Mxfp4MoETriton.can_implement(experts, H200).reason)

    monkeypatch.setenv(moe_backend.BACKEND_VARIABLE, "emulation")
    moe_backend.reset_choice()
    off = Mxfp4MoETriton.can_implement(experts, MI355)
    assert not off.accepted and not off.applicable
    assert off.reason == ("MoE backend 'emulation' (from KERNELBAY_MXFP4_MOE_BACKEND) selects "
                          "mxfp4-moe-emulation")
    emulation = Mxfp4MoEEmulation.can_implement(experts, MI355)
    assert "MoE backend 'emulation' (from KERNELBAY_MXFP4_MOE_BACKEND)" in emulation.describe()

    monkeypatch.setenv(moe_backend.BACKEND_VARIABLE, "Triton")
    moe_backend.reset_choice()
    on_cuda = Mxfp4MoETriton.can_implement(experts, H200)
    assert on_cuda.accepted and "offered because of the variable" in on_cuda.describe()

    monkeypatch.setenv(moe_backend.BACKEND_VARIABLE, "cutlass")
    moe_backend.reset_choice()
    with pytest.raises(ValueError, match=r"KERNELBAY_MXFP4_MOE_BACKEND='cutlass' is not a "
                                         r"valid MXFP4 MoE backend; valid: \['auto', 'triton', "
                                         r"'emulation'\]"):
        moe_backend.load_choice()
    from kernelbay_quant_mxfp4_rocm import plugin

    with pytest.raises(ValueError, match="KERNELBAY_MXFP4_MOE_BACKEND='cutlass'"):
        plugin.kernelbay_linear_methods()  # the plugin's load fails, naming the variable


def test_deprecated_alias_warns_once(monkeypatch: pytest.MonkeyPatch,
                                     caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(moe_backend._state, "warned", False)
    monkeypatch.setenv(moe_backend.DEPRECATED_VARIABLE, "emulation")
    with caplog.at_level(logging.WARNING, logger="kernelbay.plugins.quant_mxfp4_rocm"):
        first = moe_backend.load_choice()
        assert moe_backend.load_choice() is first  # read once
        from kernelbay_quant_mxfp4_rocm import plugin

        plugin.kernelbay_linear_methods()  # loading again neither rereads nor warns
        moe_backend.reset_choice()
        again = moe_backend.load_choice()  # rereading does not warn twice either
    assert first == again == moe_backend.MoEBackendChoice(
        "emulation", "KERNELBAY_ROCM_MXFP4_MOE, deprecated")
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == ["KERNELBAY_ROCM_MXFP4_MOE is deprecated; set "
                        "KERNELBAY_MXFP4_MOE_BACKEND=emulation instead"]
    # the new name wins over the alias
    monkeypatch.setenv(moe_backend.BACKEND_VARIABLE, "triton")
    assert moe_backend.read_choice().describe() == (
        "MoE backend 'triton' (from KERNELBAY_MXFP4_MOE_BACKEND)")
    with pytest.raises(ValueError, match=r"KERNELBAY_ROCM_MXFP4_MOE='x' is not a valid"):
        moe_backend.read_choice({moe_backend.DEPRECATED_VARIABLE: "x"})


@pytest.mark.gpu
@pytest.mark.parametrize("activation", [None, "mxfp4-dynamic", "mxfp8-dynamic"])
def test_gpu_moe_realistic(activation: str | None) -> None:
    experts, hidden, inter, tokens = 8, 2048, 768, 64
    weights = _weights(experts, hidden, inter, 5)
    request = _request(mx(activation), experts, hidden, inter)
    triton_method, emulation = Mxfp4MoETriton(request), Mxfp4MoEEmulation(request)
    layer_t = _load(triton_method, weights).cuda()
    layer_e = _load(emulation, weights).cuda()
    ids, topk = _routing(tokens, experts, 2, 6)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(7)).bfloat16()
    x, ids, topk = x.cuda(), ids.cuda(), topk.cuda()
    y = triton_method.apply_moe(layer_t, x, ids, topk).float()
    want = emulation.apply_moe(layer_e, x, ids, topk).float()
    if activation is None:  # as in test_moe_matches_the_emulation
        exact = _float64_moe(weights, x.cpu(), ids.cpu(), topk.cpu())
        errors = [float((v.cpu().double() - exact).norm() / exact.norm()) for v in (y, want)]
        assert errors[0] < 2**-8 and errors[0] <= errors[1] * 1.25, errors
        return
    err = (y - want).norm() / want.norm()
    assert err < 2**-8, err.item()


@pytest.mark.gpu
@pytest.mark.parametrize("activation", [None, "mxfp4-dynamic"])
def test_gpu_dense_realistic(activation: str | None) -> None:
    n, k = 4096, 7168
    g = torch.Generator().manual_seed(8)
    packed, scales = quantize_mx(torch.randn(n, k, generator=g) * 0.02, "e2m1", "even")
    request = LinearRequest(k, n, mx(activation), "bfloat16")
    triton_method, emulation = Mxfp4TritonLinear(request), Mxfp4EmulationLinear(request)
    layer_t = _dense_layer(triton_method, packed, scales, None)
    layer_e = _dense_layer(emulation, packed, scales, None)
    for m in (1, 16, 200):
        x = torch.randn(m, k, generator=g).bfloat16().cuda()
        # cuBLAS may reduce bf16 split-K partials in reduced precision (torch's default)
        torch.testing.assert_close(triton_method.apply(layer_t, x).float(),
                                   emulation.apply(layer_e, x).float(), rtol=2**-5, atol=1e-3)
