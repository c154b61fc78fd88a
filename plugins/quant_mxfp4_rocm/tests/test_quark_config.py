"""Quark config recognition and per-layer matching: exclude, patterns, layer type, global."""

from __future__ import annotations

from typing import Any

import pytest
from kernelbay.device import parse_device
from kernelbay.errors import ConfigError
from kernelbay.requests import UNQUANTIZED, FormatRequest, QuantScheme
from kernelbay_quant_mxfp4_rocm.quark_format import QuarkFormat
from quark_checkpoints import (
    A_MXFP4,
    A_MXFP8,
    FP8_TENSOR,
    W_MXFP4,
    layer,
    quark_config,
    spec,
)

CPU = parse_device("cpu")
Q = "model.layers.0.self_attn.q_proj"
K = "model.layers.0.self_attn.k_proj"
DOWN = "model.layers.1.mlp.down_proj"


def mx(activation: str | None, mode: str = "even") -> QuantScheme:
    return QuantScheme("mxfp4", "e2m1", (1, 32), "e8m0", False, activation, "quark",
                       (("scale_mode", mode),))


def _fmt(config: dict[str, Any]) -> QuarkFormat:
    request = FormatRequest.from_config(config, "config.json")
    verdict = QuarkFormat.can_implement(request, CPU)
    assert verdict.accepted, verdict.reason
    return QuarkFormat(request)


def _reason(config: dict[str, Any]) -> str:
    verdict = QuarkFormat.can_implement(FormatRequest.from_config(config), CPU)
    assert not verdict.accepted
    return verdict.reason


def test_global_scheme_and_activation_kinds() -> None:
    assert _fmt(quark_config()).scheme_for(Q) == mx("mxfp4-dynamic")
    assert _fmt(quark_config(layer(W_MXFP4))).scheme_for(Q) == mx(None)
    assert _fmt(quark_config(layer(W_MXFP4, A_MXFP8))).scheme_for(Q) == mx("mxfp8-dynamic")
    floor = _fmt(quark_config(layer(W_MXFP4, spec("fp4", dynamic=True, mode="floor"))))
    assert floor.scheme_for(Q) == mx("mxfp4-dynamic", "floor")
    # Quark treats a missing scale_calculation_mode as "even".
    assert _fmt(quark_config(layer(spec(mode=None)))).scheme_for(Q) == mx(None)
    fp8 = _fmt(quark_config(layer(FP8_TENSOR, {**FP8_TENSOR, "is_dynamic": True})))
    assert fp8.scheme_for(Q) == QuantScheme("fp8", "float8_e4m3fn", None, "float32", False,
                                            "fp8-dynamic", "quark")
    # The legacy spelling: dtype "mx" with the element type, "dynamic" for "is_dynamic".
    legacy = {k: v for k, v in spec("mx").items() if k != "is_dynamic"}
    legacy.update({"mx_element_dtype": "fp4", "dynamic": False})
    assert _fmt(quark_config(layer(legacy))).scheme_for(Q) == mx(None)


def test_matching_order_exclude_patterns_type_global() -> None:
    fmt = _fmt(quark_config(
        layer(W_MXFP4, A_MXFP4),
        layers={"*q_proj": layer(W_MXFP4), "*mlp.down_proj": layer(W_MXFP4, A_MXFP8),
                "model.layers.1.*": layer(W_MXFP4, A_MXFP8)},
        types={"Linear": layer(W_MXFP4, spec("fp4", dynamic=True, mode="floor"))},
        exclude=["lm_head", "model.layers.1.self_attn.q_proj", "re:.*layers\\.0\\.mlp\\.up"]))
    assert fmt.scheme_for(Q) == mx(None)  # pattern beats type and global
    assert fmt.scheme_for(DOWN) == mx("mxfp8-dynamic")  # two agreeing patterns
    assert fmt.scheme_for(K) == mx("mxfp4-dynamic", "floor")  # layer type beats global
    assert fmt.scheme_for("model.layers.1.self_attn.q_proj") == UNQUANTIZED  # exclude first
    assert fmt.scheme_for("model.layers.0.mlp.up_proj") == UNQUANTIZED  # re: exclude
    assert fmt.scheme_for("lm_head") == UNQUANTIZED
    assert fmt.explain(K)[1] == "layer_type_quant_config['Linear']"
    no_type = _fmt(quark_config(layer(W_MXFP4, A_MXFP4), exclude=["*.mlp.*"]))
    assert no_type.scheme_for(K) == mx("mxfp4-dynamic")  # global
    assert no_type.scheme_for(DOWN) == UNQUANTIZED  # fnmatch exclude
    assert no_type.explain(K)[1] == "global_quant_config"
    # Layer types other than Linear do not apply to linear layers.
    conv = _fmt(quark_config(layer(W_MXFP4), types={"Conv2d": layer(W_MXFP4, A_MXFP4)}))
    assert conv.scheme_for(K) == mx(None)
    # A global config with weight null leaves unmatched layers unquantized.
    only = _fmt(quark_config(layer(None), layers={"*down_proj": layer(W_MXFP4)}))
    assert only.scheme_for(DOWN) == mx(None) and only.scheme_for(Q) == UNQUANTIZED


def test_disagreeing_patterns_fail() -> None:
    fmt = _fmt(quark_config(layers={"*q_proj": layer(W_MXFP4),
                                    "model.layers.0.*": layer(W_MXFP4, A_MXFP8)}))
    with pytest.raises(ConfigError, match=r"different schemes.*'\*q_proj'"):
        fmt.scheme_for(Q)


def test_fused_shards_must_agree() -> None:
    fmt = _fmt(quark_config(layers={"*k_proj": layer(W_MXFP4, A_MXFP8)},
                            exclude=["lm_head", "*layers.1.mlp.up_proj"]))
    assert fmt.scheme_for("model.layers.0.mlp.gate_up_proj") == mx("mxfp4-dynamic")
    with pytest.raises(ConfigError, match=r"qkv_proj.*k_proj: mxfp4 .*mxfp8-dynamic"):
        fmt.scheme_for("model.layers.0.self_attn.qkv_proj")
    with pytest.raises(ConfigError, match=r"up_proj: unquantized.*excluded"):
        fmt.scheme_for("model.layers.1.mlp.gate_up_proj")


def test_rejections_name_the_entry_and_the_supported_set() -> None:
    int4 = spec("int4", qscheme="per_group", group_size=128, scale_format="float32")
    reason = _reason(quark_config(layers={"*down_proj": layer(int4)}))
    assert "layer_quant_config['*down_proj'].weight is int4 per_group 128" in reason
    assert "fp4 per_group 32 e8m0" in reason
    assert "fp4 per_group 16" in _reason(quark_config(layer(spec(group_size=16))))
    static_mx = _reason(quark_config(layer(W_MXFP4, spec("fp4", dynamic=False))))
    assert "input_tensors is fp4 per_group 32 e8m0 static" in static_mx
    assert "two-stage" in _reason(quark_config(layer([W_MXFP4, W_MXFP4])))  # type: ignore[arg-type]
    biased = layer(W_MXFP4)
    biased["bias"] = W_MXFP4
    assert "quantized biases" in _reason(quark_config(biased))
    assert "quantizes no weights" in _reason(quark_config(layer(None)))
    assert "no global_quant_config" in _reason({"quant_method": "quark"})
    assert "quantizes no weights" in _reason({"quant_method": "quark", "global_quant_config": {},
                                              "exclude": ["lm_head"]})
    assert "regular expression" in _reason(quark_config(exclude=["re:(unclosed"]))
    for method in (None, "modelopt", "compressed-tensors"):
        config = None if method is None else {**quark_config(), "quant_method": method}
        verdict = QuarkFormat.can_implement(FormatRequest.from_config(config), CPU)
        assert not verdict.accepted and "'quark'" in verdict.reason


def test_moe_routers_stay_unquantized_and_experts_follow_the_config() -> None:
    fmt = _fmt(quark_config(exclude=["lm_head", "*self_attn*"]))
    assert fmt.scheme_for("model.layers.3.mlp.gate") == UNQUANTIZED
    assert fmt.explain("model.layers.3.mlp.gate")[1] == "MoE routers stay unquantized"
    assert fmt.scheme_for("model.layers.3.mlp.experts.5.gate_proj") == mx("mxfp4-dynamic")
    assert fmt.scheme_for("model.layers.3.mlp.shared_experts.down_proj") == mx("mxfp4-dynamic")
    assert fmt.scheme_for("model.layers.3.self_attn.kv_b_proj") == UNQUANTIZED
    # gate_proj is a projection, not a router.
    assert fmt.scheme_for("model.layers.0.mlp.gate_proj") == mx("mxfp4-dynamic")
    assert fmt.source_name("model.layers.3.mlp", "experts.5.gate_proj.weight_scale") == (
        "model.layers.3.mlp.experts.5.gate_proj.weight_scale")
