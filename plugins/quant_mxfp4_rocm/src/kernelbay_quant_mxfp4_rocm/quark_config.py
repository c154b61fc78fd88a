"""AMD Quark's exported quantization config, read as Quark writes it (torch-free).

``QConfig.to_dict()`` (amd-quark 0.13) writes ``quant_method: "quark"``,
``global_quant_config``, ``layer_quant_config`` {fnmatch pattern: layer config},
``layer_type_quant_config`` {module class name such as ``"Linear"``: layer config},
``exclude`` (module names / patterns), ``kv_cache_quant_config``, ``algo_config``,
``softmax_quant_spec``, ``quant_mode``, ``version``, and the exporter adds ``export``
(``pack_method``, ``kv_cache_group`` ...). A layer config has ``weight``, ``input_tensors``,
``output_tensors``, ``bias`` (a tensor spec, a list of specs for two-stage schemes, or null)
and ``target_device``. A tensor spec (``QTensorConfig.to_dict()``) has ``dtype`` (``fp4``,
``fp8_e4m3``, ``int8`` ..., or ``mx`` with ``mx_element_dtype``), ``qscheme`` (``per_tensor``,
``per_channel``, ``per_group``), ``group_size``, ``scale_format`` (``e8m0`` for OCP MX),
``scale_calculation_mode`` (``even`` default, ``floor``, ``ceil``), ``is_dynamic`` (legacy
exports: ``dynamic``), ``round_method``, ``ch_axis``, ``symmetric``, ``observer_cls`` ...

Per layer, Quark (``get_layer_quant_config``) and vLLM's Quark loader decide in this order:
``exclude`` (fnmatch; vLLM also takes ``re:`` patterns), then the layer patterns, then the
layer type, then the global config; a fused module's shards must all resolve the same way.
MoE routers (``mlp.gate``) are never quantized: Quark only quantizes ``nn.Linear`` modules
and transformers' routers are not.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kernelbay.errors import ConfigError
from kernelbay.requests import UNQUANTIZED, QuantScheme

__all__ = [
    "FUSED_SHARDS",
    "LINEAR_TYPES",
    "MX_GROUP",
    "QuarkConfig",
    "QuarkLayer",
    "QuarkTensorSpec",
    "exclude_match",
    "is_router",
    "parse_quark",
]

MX_GROUP = 32
#: layer_type_quant_config keys that name linear layers (``nn.Linear.__name__``).
LINEAR_TYPES = ("Linear",)
#: Fused projections an executor may build, and the checkpoint modules they are made of.
FUSED_SHARDS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
_ROUTER_PARENTS = ("mlp", "block_sparse_moe", "moe")
_ROUTER_LEAVES = ("router", "shared_expert_gate")
_WEIGHT_SUPPORTED = "fp4 per_group 32 e8m0 (OCP MXFP4) or fp8_e4m3 per_tensor (FP8)"
_INPUT_SUPPORTED = ("dynamic fp4 / fp8_e4m3 per_group 32 e8m0 (OCP MX) or fp8_e4m3 per_tensor "
                    "(FP8)")


@dataclass(frozen=True)
class QuarkTensorSpec:
    """The fields of one Quark tensor spec that decide a scheme."""

    dtype: str
    qscheme: str | None
    group_size: int | None
    scale_format: str | None
    is_dynamic: bool | None
    scale_calculation_mode: str | None

    @classmethod
    def parse(cls, raw: object, where: str) -> QuarkTensorSpec | None:
        """Read one spec (``None`` for null); ``ConfigError`` naming ``where`` if malformed."""
        if raw is None:
            return None
        if isinstance(raw, list):
            raise ConfigError(f"{where} is a list of {len(raw)} specs (a two-stage scheme); "
                              "only single-stage specs are supported")
        if not isinstance(raw, dict) or not isinstance(raw.get("dtype"), str):
            raise ConfigError(f"{where} must be a tensor spec with a 'dtype', got {raw!r}")
        dtype = raw["dtype"]
        if dtype == "mx":  # legacy spelling: dtype "mx" + the element type
            dtype = str(raw.get("mx_element_dtype"))
        dynamic = raw.get("is_dynamic", raw.get("dynamic"))
        return cls(dtype, raw.get("qscheme"), raw.get("group_size"), raw.get("scale_format"),
                   None if dynamic is None else bool(dynamic),
                   raw.get("scale_calculation_mode"))

    @property
    def is_mx(self) -> bool:
        """An OCP MX spec: per_group, 32 elements, E8M0 scales."""
        return (self.qscheme == "per_group" and self.group_size == MX_GROUP
                and self.scale_format == "e8m0")

    @property
    def is_per_tensor(self) -> bool:
        """One scale for the whole tensor."""
        return self.qscheme == "per_tensor"

    def describe(self) -> str:
        """Short text such as ``fp4 per_group 32 e8m0 dynamic``."""
        bits = [self.dtype, str(self.qscheme)]
        if self.group_size is not None:
            bits.append(str(self.group_size))
        if self.scale_format:
            bits.append(self.scale_format)
        if self.is_dynamic is not None:
            bits.append("dynamic" if self.is_dynamic else "static")
        return " ".join(bits)


@dataclass(frozen=True)
class QuarkLayer:
    """One layer config (weight and input specs) and the scheme it gives."""

    weight: QuarkTensorSpec | None
    input: QuarkTensorSpec | None
    scheme: QuantScheme

    @classmethod
    def parse(cls, raw: object, where: str) -> QuarkLayer:
        """Read and classify one layer config; ``ConfigError`` names anything unsupported."""
        if not isinstance(raw, dict):
            raise ConfigError(f"{where} must be a layer config mapping, got {raw!r}")
        weight = QuarkTensorSpec.parse(raw.get("weight"), f"{where}.weight")
        inputs = QuarkTensorSpec.parse(raw.get("input_tensors"), f"{where}.input_tensors")
        if raw.get("bias") is not None:
            raise ConfigError(f"{where}.bias is {raw['bias']!r}; quantized biases are not "
                              "supported (expected null)")
        # output_tensors (e.g. the FP8 KV cache on k_proj/v_proj) belong to attention.
        return cls(weight, inputs, _scheme(weight, inputs, where))


def _mode(spec: QuarkTensorSpec | None) -> str:
    # Quark's observers treat a missing mode as "even".
    return (spec.scale_calculation_mode if spec is not None and spec.scale_calculation_mode
            else "even")


def _scheme(weight: QuarkTensorSpec | None, inputs: QuarkTensorSpec | None,
            where: str) -> QuantScheme:
    if weight is None:
        if inputs is not None:
            raise ConfigError(f"{where} quantizes input_tensors ({inputs.describe()}) without "
                              "weights, which is not supported")
        return UNQUANTIZED
    activation: str | None = None
    if inputs is not None:
        if inputs.is_mx and inputs.dtype in ("fp4", "fp8_e4m3") and inputs.is_dynamic:
            activation = "mxfp4-dynamic" if inputs.dtype == "fp4" else "mxfp8-dynamic"
        elif inputs.dtype == "fp8_e4m3" and inputs.is_per_tensor:
            activation = "fp8-dynamic" if inputs.is_dynamic else "fp8-static"
        else:
            raise ConfigError(f"{where}.input_tensors is {inputs.describe()}; supported: "
                              f"{_INPUT_SUPPORTED}")
    if weight.dtype == "fp4" and weight.is_mx:
        options = (("scale_mode", _mode(inputs if activation and "mx" in activation
                                         else weight)),)
        return QuantScheme("mxfp4", "e2m1", (1, MX_GROUP), "e8m0", False, activation, "quark",
                           options)
    if weight.dtype == "fp8_e4m3" and weight.is_per_tensor:
        if activation is not None and not activation.startswith("fp8"):
            raise ConfigError(f"{where} pairs fp8_e4m3 per_tensor weights with "
                              f"{activation} activations, which is not supported")
        return QuantScheme("fp8", "float8_e4m3fn", None, "float32", False, activation, "quark")
    raise ConfigError(f"{where}.weight is {weight.describe()}; supported: {_WEIGHT_SUPPORTED}")


def is_router(module: str) -> bool:
    """True for an MoE router (``model.layers.3.mlp.gate``, ``...router``). Quark quantizes
    ``nn.Linear`` modules only and transformers' routers are not, so an export never lists
    them in ``exclude``; loaders (vLLM) build them unquantized."""
    parts = module.split(".")
    if parts[-1] in _ROUTER_LEAVES:
        return True
    return parts[-1] == "gate" and len(parts) > 1 and parts[-2] in _ROUTER_PARENTS


def exclude_match(module: str, patterns: tuple[str, ...]) -> str | None:
    """The ``exclude`` entry that matches ``module``: exact name, ``re:`` regular expression
    (``re.match``), or fnmatch wildcard; ``None`` when none does."""
    for pattern in patterns:
        if pattern == module:
            return pattern
        if pattern.startswith("re:"):
            if re.match(pattern[3:], module):
                return pattern
        elif fnmatch.fnmatchcase(module, pattern):
            return pattern
    return None


@dataclass(frozen=True)
class QuarkConfig:
    """A validated Quark config: every layer config parsed and classified."""

    global_layer: QuarkLayer
    layers: Mapping[str, QuarkLayer]
    layer_types: Mapping[str, QuarkLayer]
    exclude: tuple[str, ...]

    def _shard(self, module: str) -> tuple[QuarkLayer | None, str]:
        if is_router(module):
            return None, "MoE routers stay unquantized"
        hit = exclude_match(module, self.exclude)
        if hit is not None:
            return None, f"excluded by {hit!r}"
        matches = [(p, layer) for p, layer in self.layers.items()
                   if fnmatch.fnmatchcase(module, p)]
        if matches:
            # Quark takes the first pattern in file order; the order is not kept on the way
            # here (the config is canonical JSON), so matching patterns must agree.
            if len({layer.scheme for _, layer in matches}) > 1:
                named = ", ".join(f"{p!r}: {layer.scheme.describe()}" for p, layer in matches)
                raise ConfigError(f"module {module!r} matches layer_quant_config patterns with "
                                  f"different schemes ({named}); make them disjoint")
            return matches[0][1], f"layer_quant_config[{matches[0][0]!r}]"
        for layer_type in LINEAR_TYPES:
            if layer_type in self.layer_types:
                return self.layer_types[layer_type], f"layer_type_quant_config[{layer_type!r}]"
        return self.global_layer, "global_quant_config"

    def resolve(self, module: str) -> tuple[QuantScheme, str]:
        """The scheme of linear ``module`` and which config entry decided it.

        A fused module (``qkv_proj``, ``gate_up_proj``) resolves each shard; shards that
        disagree (in scheme or in being excluded) raise ``ConfigError`` naming each.
        """
        parent, _, leaf = module.rpartition(".")
        shards = FUSED_SHARDS.get(leaf, ())
        if not shards or module in self.exclude:
            layer, why = self._shard(module)
            return (UNQUANTIZED if layer is None else layer.scheme), why
        found = {}
        for shard in shards:
            name = f"{parent}.{shard}" if parent else shard
            layer, why = self._shard(name)
            found[name] = (UNQUANTIZED if layer is None else layer.scheme, why)
        if len({scheme for scheme, _ in found.values()}) > 1:
            detail = "; ".join(f"{s}: {sc.describe()} ({why})" for s, (sc, why) in found.items())
            raise ConfigError(f"fused module {module!r} has shards with different "
                              f"quantization configs, which cannot share one weight: {detail}")
        return next(iter(found.values()))


def _patterns(value: object, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where} must be a list of module names or patterns, got {value!r}")
    for entry in value:
        if entry.startswith("re:"):
            try:
                re.compile(entry[3:])
            except re.error as exc:
                raise ConfigError(f"{where} entry {entry!r} is not a valid regular expression: "
                                  f"{exc}") from exc
    return tuple(value)


def _table(value: object, where: str) -> dict[str, QuarkLayer]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a mapping, got {value!r}")
    return {key: QuarkLayer.parse(raw, f"{where}[{key!r}]") for key, raw in value.items()}


def parse_quark(config: Mapping[str, Any]) -> QuarkConfig:
    """Validate a Quark ``quantization_config``; ``ConfigError`` names the first bad entry."""
    if "global_quant_config" not in config:
        raise ConfigError("has no global_quant_config (Quark always writes one)")
    parsed = QuarkConfig(
        QuarkLayer.parse(config["global_quant_config"], "global_quant_config"),
        _table(config.get("layer_quant_config"), "layer_quant_config"),
        _table(config.get("layer_type_quant_config"), "layer_type_quant_config"),
        _patterns(config.get("exclude"), "exclude"),
    )
    entries = [parsed.global_layer, *parsed.layers.values(), *parsed.layer_types.values()]
    if not any(layer.scheme.is_quantized for layer in entries):
        raise ConfigError("quantizes no weights: global_quant_config, layer_quant_config and "
                          "layer_type_quant_config all have 'weight': null")
    return parsed
