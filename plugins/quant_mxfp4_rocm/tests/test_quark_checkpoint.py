"""Quark checkpoints on disk: scale-name table, logical shapes, loud errors, and the plan."""

from __future__ import annotations

import importlib.metadata as metadata
from pathlib import Path

import pytest
import torch
from kernelbay.checkpoint import CheckpointFolder, TensorInfo
from kernelbay.device import parse_device
from kernelbay.errors import CheckpointError
from kernelbay.plan import plan_checkpoint
from kernelbay.plugins import ENTRY_POINT_GROUP, Registry
from kernelbay.policy import Policy
from kernelbay.testing import load_method
from kernelbay.testing.interpreter import triton_interpreter_problem
from kernelbay_quant_mxfp4_rocm.quark_format import QuarkFormat
from kernelbay_quant_mxfp4_rocm.quark_names import (
    MODULE_SCALES,
    RENAMED_SCALES,
    is_scale_name,
    match_scale_tensors,
)
from quark_checkpoints import A_MXFP4, W_MXFP4, layer, quark_config, write_quark

ATTN = "model.layers.0.self_attn"
Q = f"{ATTN}.q_proj"


def _infos(*names: str) -> dict[str, TensorInfo]:
    return {n: TensorInfo(n, (1,), "float32", "/ckpt/model.safetensors", 0, 4) for n in names}


@pytest.fixture
def registry() -> Registry:
    reg = Registry(Policy(plugins=frozenset(["quant_mxfp4_rocm"])))
    (ep,) = [e for e in metadata.entry_points(group=ENTRY_POINT_GROUP)
             if e.name == "quant_mxfp4_rocm"]
    reg.load_entry_point(ep)
    return reg


def test_name_table() -> None:
    assert MODULE_SCALES == ("weight_scale", "input_scale", "output_scale")
    assert RENAMED_SCALES == {"k_scale": ("k_proj", "output_scale"),
                              "v_scale": ("v_proj", "output_scale")}
    modules = [Q, f"{ATTN}.k_proj", f"{ATTN}.v_proj"]
    found = match_scale_tensors(_infos(f"{Q}.weight", f"{Q}.weight_scale", f"{Q}.input_scale",
                                       f"{ATTN}.k_scale", f"{ATTN}.v_scale",
                                       "model.norm.weight"), modules)
    assert found == {f"{Q}.weight_scale": (Q, "weight_scale"),
                     f"{Q}.input_scale": (Q, "input_scale"),
                     f"{ATTN}.k_scale": (f"{ATTN}.k_proj", "output_scale"),
                     f"{ATTN}.v_scale": (f"{ATTN}.v_proj", "output_scale")}
    assert is_scale_name("x.weight_zero_point") and not is_scale_name("x.weight")


def test_unmatched_scales_are_listed() -> None:
    tensors = _infos(f"{Q}.weight_scale", f"{Q}.weight_scale_2", "model.lm_head_scale",
                     f"{ATTN}.k_scale", "model.layers.9.mlp.down_proj.weight_scale")
    with pytest.raises(CheckpointError) as err:
        match_scale_tensors(tensors, [Q])
    text = str(err.value)
    assert "4 scale tensor(s) match no linear layer parameter" in text
    for name in (f"{Q}.weight_scale_2", "model.lm_head_scale", f"{ATTN}.k_scale",
                 "model.layers.9.mlp.down_proj.weight_scale"):
        assert repr(name) in text
    assert "<parent>.k_scale -> <parent>.k_proj.output_scale" in text
    assert f"{Q}.weight_scale'" not in text.replace(f"{Q}.weight_scale_2", "")


def test_linear_modules_shapes_and_kv_scale_names(tmp_path: Path) -> None:
    kv = {f"model.layers.{i}.self_attn.{x}_scale": torch.tensor(0.02)
          for i in (0, 1) for x in "kv"}
    path = write_quark(str(tmp_path / "q"), quark_config(), lambda m: m != "lm_head", kv)
    folder = CheckpointFolder(path)
    fmt = QuarkFormat(folder.format_request())
    modules = {m.name: m for m in fmt.linear_modules(folder.tensors)}
    assert len(modules) == 15
    assert (modules[Q].in_features, modules[Q].out_features, modules[Q].dtype) == (64, 64, "uint8")
    assert modules["model.layers.0.mlp.down_proj"].in_features == 128
    assert modules["lm_head"].dtype == "bfloat16"
    assert fmt.source_name(f"{ATTN}.k_proj", "output_scale") == f"{ATTN}.k_scale"
    assert fmt.source_name(Q, "weight_scale") == f"{Q}.weight_scale"
    bits = torch.tensor([0, 127, 254], dtype=torch.uint8)
    assert fmt.convert(Q, "weight_scale", bits) is bits


@pytest.mark.skipif(not hasattr(torch, "float8_e8m0fnu"),
                    reason="this torch has no float8_e8m0fnu (added in torch 2.7)")
def test_e8m0_typed_scales_convert_to_their_bytes(tmp_path: Path) -> None:
    path = write_quark(str(tmp_path / "q"), quark_config(), lambda m: m != "lm_head")
    fmt = QuarkFormat(CheckpointFolder(path).format_request())
    bits = torch.tensor([0, 127, 254], dtype=torch.uint8)
    assert torch.equal(fmt.convert(Q, "weight_scale", bits.view(torch.float8_e8m0fnu)), bits)


def test_mismatches_fail_loudly(tmp_path: Path) -> None:
    # A stray second-stage scale that no rule explains.
    stray = {f"{Q}.weight_scale_2": torch.tensor(1.0)}
    path = write_quark(str(tmp_path / "a"), quark_config(), lambda m: m != "lm_head", stray)
    folder = CheckpointFolder(path)
    with pytest.raises(CheckpointError, match="weight_scale_2"):
        QuarkFormat(folder.format_request()).linear_modules(folder.tensors)
    # The config excludes q_proj, but the file holds it packed.
    path = write_quark(str(tmp_path / "b"), quark_config(exclude=["lm_head", Q]),
                       lambda m: m != "lm_head")
    folder = CheckpointFolder(path)
    with pytest.raises(CheckpointError, match=r"q_proj.weight.*uint8.*unquantized.*excluded"):
        QuarkFormat(folder.format_request()).linear_modules(folder.tensors)
    # The config quantizes lm_head (not excluded), but the file holds it in bf16.
    path = write_quark(str(tmp_path / "c"), quark_config(exclude=[]), lambda m: m != "lm_head")
    folder = CheckpointFolder(path)
    with pytest.raises(CheckpointError, match=r"lm_head.weight.*bfloat16.*expected uint8"):
        QuarkFormat(folder.format_request()).linear_modules(folder.tensors)


def test_plan_chooses_quark_and_mxfp4_methods(tmp_path: Path, registry: Registry) -> None:
    config = quark_config(layer(W_MXFP4, A_MXFP4), layers={"*down_proj": layer(W_MXFP4)})
    path = write_quark(str(tmp_path / "q"), config, lambda m: m != "lm_head")
    # the Triton method on its ROCm home, the reference elsewhere (on CUDA unless forced)
    for device, method in (("cpu", "mxfp4-emulation"), ("gfx950", "mxfp4-triton"),
                           ("sm_90", "mxfp4-emulation")):
        plan = plan_checkpoint(path, registry=registry, device=parse_device(device))
        assert plan.format.chosen == "quark"
        chosen = {d.module: d.chosen for d in plan.linears}
        assert chosen.pop("lm_head") == "torch-unquantized"
        assert set(chosen.values()) == {method}, chosen
    down = next(d for d in plan.linears if d.module == "model.layers.0.mlp.down_proj")
    assert down.request.scheme.activation is None  # type: ignore[union-attr]
    q = next(d for d in plan.linears if d.module == Q)
    assert q.request.scheme.activation == "mxfp4-dynamic"  # type: ignore[union-attr]
    assert q.request.in_features == 64  # type: ignore[union-attr]
    plan2 = plan_checkpoint(path, registry=registry, device=parse_device("gfx942"), tp_size=2)
    assert {d.chosen for d in plan2.linears if d.module != "lm_head"} == {"mxfp4-triton"}



def test_checkpoint_tensors_load_into_the_emulation(tmp_path: Path,
                                                    registry: Registry) -> None:
    """Plan, read each spec by ``source_name``/``convert``, and compare with the reference.
    The method chosen for gfx950 is the Triton one: it runs on the GPU where there is one
    (its kernels are the same on CUDA), under the interpreter elsewhere."""
    import torch.nn.functional as F
    from kernelbay.formats import dequantize_mx, quantize_mx
    from safetensors.torch import load_file

    path = write_quark(str(tmp_path / "q"), quark_config(), lambda m: m != "lm_head")
    plan = plan_checkpoint(path, registry=registry, device=parse_device("gfx950"))
    folder = CheckpointFolder(path)
    fmt = QuarkFormat(folder.format_request())
    fmt.linear_modules(folder.tensors)
    stored = load_file(f"{path}/model.safetensors")
    decision = next(d for d in plan.linears if d.module == Q)
    assert decision.selection is not None
    method = decision.selection.backend(decision.request)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and (problem := triton_interpreter_problem()) is not None:
        pytest.skip(problem)
    layer = load_method(method, {name: fmt.convert(Q, name, stored[fmt.source_name(Q, name)])
                                 for name in method.tensor_specs()}).to(device)
    w = dequantize_mx(stored[f"{Q}.weight"], stored[f"{Q}.weight_scale"], "e2m1")
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    xq = dequantize_mx(*quantize_mx(x, "e2m1", "even"), "e2m1")
    y = method.apply(layer, x.to(device)).cpu()
    ref = F.linear(xq.double(), w.double())
    # exact products summed in float32 in any order, then one rounding to bf16
    bound = (ref.abs() * 2.0**-8
             + x.shape[-1] * 2.0**-22 * F.linear(xq.abs().double(), w.abs().double()))
    assert y.dtype == torch.bfloat16 and bool(((y.double() - ref).abs() <= bound).all())
