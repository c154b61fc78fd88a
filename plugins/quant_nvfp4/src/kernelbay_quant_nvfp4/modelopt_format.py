"""NVIDIA ModelOpt checkpoints (``quant_method: "modelopt"``).

The config comes from ``config.json`` → ``quantization_config`` (newer exports; it also carries
a compressed-tensors style ``config_groups`` block and spells the exclusions ``ignore``) and/or
``hf_quant_config.json`` → ``quantization`` (``exclude_modules``). The core hands the first in
``FormatRequest.config`` and the side file in ``FormatRequest.extra``; a field missing from one
is read from the other, and the two must not disagree on ``quant_algo``.

``quant_algo`` (any case: ModelOpt 0.47's HF exporter writes ``fp8_pb_wo`` in lower case):

    NVFP4            E2M1 weights, E4M3 scales per 1x16, fp32 weight_scale_2, input_scale
    W4A16_NVFP4      NVFP4 weights, no input_scale (weight-only)
    FP8              E4M3 weights, fp32 per-tensor weight_scale and static input_scale
    FP8_PB_WO        E4M3 weights, fp32 weight_scale per 128x128 tile, bf16 activations
    MIXED_PRECISION  ``quantized_layers`` {module prefix: {quant_algo, group_size?}} of the
                     above; unlisted layers stay unquantized

``exclude_modules`` / ``ignore`` entries match exact, then prefix, then fnmatch wildcard;
``lm_head`` and embeddings stay unquantized whatever the config says.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from kernelbay.errors import ConfigError
from kernelbay.layers.checkpoint_format import CheckpointFormat, LinearModule
from kernelbay.requests import UNQUANTIZED, FormatRequest, QuantScheme
from kernelbay.verdict import Verdict

from kernelbay_quant_nvfp4.matching import (
    fused_shards,
    is_never_quantized,
    modelopt_lookup,
    modelopt_match,
)
from kernelbay_quant_nvfp4.schemes import (
    FP8_BLOCK_MODELOPT,
    FP8_MODELOPT,
    NVFP4_BLOCK,
    check_linear,
    nvfp4_scheme,
)

if TYPE_CHECKING:
    from kernelbay.checkpoint.folder import CheckpointFolder
    from kernelbay.checkpoint.tensors import TensorInfo
    from kernelbay.device import DeviceCapability

__all__ = ["LAYER_ALGOS", "SUPPORTED_ALGOS", "ModelOptConfig", "ModelOptFormat",
           "parse_modelopt"]

#: quant_algo values one layer can have, and the scheme each gives.
LAYER_ALGOS: dict[str, QuantScheme] = {
    "NVFP4": nvfp4_scheme("modelopt", w4a4=True),
    "W4A16_NVFP4": nvfp4_scheme("modelopt", w4a4=False),
    "FP8": FP8_MODELOPT,
    "FP8_PB_WO": FP8_BLOCK_MODELOPT,
}
MIXED = "MIXED_PRECISION"
#: Every top-level quant_algo this format reads.
SUPPORTED_ALGOS: tuple[str, ...] = (*LAYER_ALGOS, MIXED)
_NVFP4_ALGOS = ("NVFP4", "W4A16_NVFP4")


@dataclass(frozen=True)
class ModelOptConfig:
    """A validated ModelOpt quantization config."""

    quant_algo: str
    exclude: tuple[str, ...]
    #: MIXED_PRECISION only: module prefix -> upper-case quant_algo.
    layers: Mapping[str, str]


def _algo(value: object, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where} quant_algo is {value!r}, not a name; supported: "
                          f"{list(SUPPORTED_ALGOS)}")
    return value.upper()


def _names(value: object, field: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{field} must be a list of module names or patterns, got {value!r}")
    return list(value)


def _group_size(entry: Mapping[str, Any], algo: str, where: str) -> None:
    size = entry.get("group_size")
    if algo in _NVFP4_ALGOS and size not in (None, NVFP4_BLOCK):
        raise ConfigError(f"{where} has group_size {size!r} for {algo}; NVFP4 blocks are "
                          f"{NVFP4_BLOCK} elements")


def parse_modelopt(config: Mapping[str, Any], extra: Mapping[str, Any]) -> ModelOptConfig:
    """Merge ``config.json``'s and ``hf_quant_config.json``'s ModelOpt configs and validate them.

    Raises ``ConfigError`` with a sentence that names the bad value and the supported set.
    """
    raw_c, raw_e = config.get("quant_algo"), extra.get("quant_algo")
    if raw_c is None and raw_e is None:
        raise ConfigError("declares no quant_algo in quantization_config or "
                          f"hf_quant_config.json; supported: {list(SUPPORTED_ALGOS)}")
    algo_c = _algo(raw_c, "quantization_config") if raw_c is not None else None
    algo_e = _algo(raw_e, "hf_quant_config.json") if raw_e is not None else None
    if algo_c is not None and algo_e is not None and algo_c != algo_e:
        raise ConfigError(f"config.json says quant_algo {raw_c!r} but hf_quant_config.json "
                          f"says {raw_e!r}; they must agree")
    algo = algo_c or algo_e
    assert algo is not None
    if algo not in SUPPORTED_ALGOS:
        raise ConfigError(f"quant_algo {(raw_c if raw_c is not None else raw_e)!r} is not "
                          f"supported; supported: {list(SUPPORTED_ALGOS)}")
    merged = {**extra, **config}
    _group_size(merged, algo, "the config")
    exclude: list[str] = []
    for source, name in ((config, "quantization_config"), (extra, "hf_quant_config.json")):
        for field in ("exclude_modules", "ignore"):
            for entry in _names(source.get(field), f"{name} {field}"):
                if entry not in exclude:
                    exclude.append(entry)
    layers: dict[str, str] = {}
    if algo == MIXED:
        table = merged.get("quantized_layers")
        if not isinstance(table, dict) or not table:
            raise ConfigError(f"quant_algo MIXED_PRECISION needs a non-empty quantized_layers "
                              f"map {{module prefix: {{quant_algo, group_size?}}}}, got "
                              f"{table!r}")
        for prefix, entry in sorted(table.items()):
            where = f"quantized_layers[{prefix!r}]"
            if not isinstance(entry, dict):
                raise ConfigError(f"{where} must be a mapping with quant_algo, got {entry!r}")
            layer_algo = _algo(entry.get("quant_algo"), where)
            if layer_algo not in LAYER_ALGOS:
                raise ConfigError(f"{where} has quant_algo {entry.get('quant_algo')!r}, which is "
                                  f"not supported; supported per layer: {list(LAYER_ALGOS)}")
            _group_size(entry, layer_algo, where)
            layers[prefix] = layer_algo
    return ModelOptConfig(algo, tuple(exclude), layers)


class ModelOptFormat(CheckpointFormat):
    """NVIDIA ModelOpt checkpoints: NVFP4, W4A16_NVFP4, FP8, FP8_PB_WO and MIXED_PRECISION
    exports, with ``exclude_modules``/``ignore`` matched exact, then prefix, then wildcard."""

    name: ClassVar[str] = "modelopt"
    api_version: ClassVar[str] = "1.0"
    priority: ClassVar[int] = 10
    summary: ClassVar[str] = "NVIDIA ModelOpt checkpoints (NVFP4, FP8, FP8_PB_WO, mixed)"
    #: ``kernelbay quantize --format modelopt-nvfp4``: what ModelOpt's ``export_hf_checkpoint``
    #: writes for ``NVFP4_DEFAULT_CFG`` (``modelopt_writer``).
    writes: ClassVar[tuple[str, ...]] = ("modelopt-nvfp4",)

    @classmethod
    def write(cls, source: CheckpointFolder, destination: str, output_format: str, *,
              progress: bool = False) -> None:
        """Quantize ``source`` into ``destination`` as ModelOpt NVFP4 (W4A4, with input
        scales calibrated on the plugin's fixed text); see ``modelopt_writer``."""
        if output_format not in cls.writes:
            raise ConfigError(f"{cls.name} writes {list(cls.writes)}, not {output_format!r}")
        from kernelbay_quant_nvfp4.modelopt_writer import write_modelopt_nvfp4

        write_modelopt_nvfp4(source, destination, progress=progress)

    @classmethod
    def can_implement(cls, request: FormatRequest, device: DeviceCapability) -> Verdict:
        del device  # reading a config does not depend on the device
        if request.quant_method != "modelopt":
            return Verdict.handles(False, f"reads quant_method 'modelopt', this checkpoint "
                                   f"declares {request.describe()}")
        try:
            parsed = parse_modelopt(request.config, request.extra)
        except ConfigError as exc:
            return Verdict.reject(f"ModelOpt config: {exc}")
        return Verdict.accept(f"quant_algo {parsed.quant_algo}")

    def __init__(self, request: FormatRequest) -> None:
        super().__init__(request)
        self.parsed = parse_modelopt(request.config, request.extra)

    def _explain(self, module: str) -> tuple[QuantScheme, str]:
        if is_never_quantized(module):
            return UNQUANTIZED, "lm_head, embeddings and MoE routers stay unquantized"
        hit = modelopt_match(module, self.parsed.exclude)
        if hit is not None:
            return UNQUANTIZED, f"excluded by {hit!r}"
        if self.parsed.quant_algo != MIXED:
            return LAYER_ALGOS[self.parsed.quant_algo], f"quant_algo {self.parsed.quant_algo}"
        found = modelopt_lookup(module, self.parsed.layers)
        if found is None:
            return UNQUANTIZED, "not listed in MIXED_PRECISION quantized_layers"
        key, algo = found
        return LAYER_ALGOS[algo], f"quantized_layers[{key!r}] is {algo}"

    def explain(self, module: str) -> tuple[QuantScheme, str]:
        """The scheme of ``module`` and why (which config entry decided it).

        A fused module (``qkv_proj``, ``gate_up_proj``) not named by the config itself takes
        its shards' scheme; shards that disagree raise ``ConfigError`` naming each.
        """
        shards = fused_shards(module)
        named = module in self.parsed.exclude or module in self.parsed.layers
        if not shards or named:
            return self._explain(module)
        found = {s: self._explain(s) for s in shards}
        schemes = {scheme for scheme, _ in found.values()}
        if len(schemes) > 1:
            detail = "; ".join(f"{s}: {sc.describe()} ({why})" for s, (sc, why) in found.items())
            raise ConfigError(f"fused module {module!r} has shards with different schemes, "
                              f"which cannot share one weight: {detail}")
        return next(iter(found.values()))

    def scheme_for(self, module: str) -> QuantScheme:
        return self.explain(module)[0]

    def linear_modules(self, tensors: Mapping[str, TensorInfo]) -> Sequence[LinearModule]:
        """Each ``<module>.weight`` linear layer with its logical shape (K = 2 x the packed
        width of NVFP4 weights), after checking its scales against its scheme."""
        found = []
        for module in super().linear_modules(tensors):
            scheme, why = self.explain(module.name)
            names = {t: f"{module.name}.{t}" for t in ("weight_scale", "weight_scale_2")}
            found.append(check_linear(module, scheme, tensors, f"{module.name}.weight", names,
                                      why))
        return found
