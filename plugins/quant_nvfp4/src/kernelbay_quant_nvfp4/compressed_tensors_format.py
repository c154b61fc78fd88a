"""compressed-tensors NVFP4 checkpoints (llm-compressor, ``format: "nvfp4-pack-quantized"``).

Config: ``quant_method: "compressed-tensors"``, ``config_groups`` whose ``weights`` are 4-bit
``float`` with ``strategy: "tensor_group"`` and ``group_size: 16`` (``input_activations`` the
same for W4A4, absent for weight-only), ``targets`` and ``ignore`` lists of module names,
``re:`` regular expressions and class names (``Linear``). A module takes the group whose
target matches it most specifically (exact name, then regex, then class); two groups
matching equally is an error. The dialect is decided by ``quant_method``: recent ModelOpt
exports also write ``config_groups`` but say ``quant_method: "modelopt"``.

Tensors, with the canonical names linear methods use:

    checkpoint               canonical        conversion
    weight_packed            weight           none (same nibble order as ModelOpt)
    weight_scale             weight_scale     none
    weight_global_scale      weight_scale_2   reciprocal: (6*448)/amax -> amax/(6*448), [1] -> []
    input_global_scale       input_scale      reciprocal, [1] -> []
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from kernelbay.errors import CheckpointError, ConfigError
from kernelbay.layers.checkpoint_format import CheckpointFormat, LinearModule
from kernelbay.requests import UNQUANTIZED, FormatRequest, QuantScheme
from kernelbay.verdict import Verdict

from kernelbay_quant_nvfp4.matching import ct_match_level, fused_shards, is_never_quantized
from kernelbay_quant_nvfp4.schemes import NVFP4_BLOCK, check_linear, nvfp4_scheme

if TYPE_CHECKING:
    import torch
    from kernelbay.checkpoint.tensors import TensorInfo
    from kernelbay.device import DeviceCapability

__all__ = ["CT_TENSOR_NAMES", "CompressedTensorsNvfp4Format", "CtConfig", "CtGroup",
           "parse_compressed_tensors"]

PACKED_FORMAT = "nvfp4-pack-quantized"

#: Canonical tensor name -> compressed-tensors checkpoint name, where they differ.
CT_TENSOR_NAMES: dict[str, str] = {
    "weight": "weight_packed",
    "weight_scale_2": "weight_global_scale",
    "input_scale": "input_global_scale",
}
# Canonical names whose stored value is the reciprocal of the canonical convention.
_RECIPROCAL = ("weight_scale_2", "input_scale")


@dataclass(frozen=True)
class CtGroup:
    """One validated NVFP4 config group."""

    name: str
    targets: tuple[str, ...]
    w4a4: bool


@dataclass(frozen=True)
class CtConfig:
    """A validated compressed-tensors NVFP4 config."""

    groups: tuple[CtGroup, ...]
    ignore: tuple[str, ...]


def _check_args(args: object, where: str) -> None:
    if not isinstance(args, dict):
        raise ConfigError(f"{where} must be a mapping, got {args!r}")
    want = {"num_bits": 4, "type": "float", "strategy": "tensor_group",
            "group_size": NVFP4_BLOCK}
    for key, value in want.items():
        if args.get(key) != value:
            raise ConfigError(f"{where}.{key} is {args.get(key)!r}; NVFP4 needs {value!r} "
                              f"(needs {want})")


def _patterns(value: object, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where} must be a list of names, 're:' patterns or class names, "
                          f"got {value!r}")
    for entry in value:
        if entry.startswith("re:"):
            try:
                re.compile(entry[3:])
            except re.error as exc:
                raise ConfigError(f"{where} entry {entry!r} is not a valid regular expression: "
                                  f"{exc}") from exc
    return tuple(value)


def parse_compressed_tensors(config: Mapping[str, Any]) -> CtConfig:
    """Validate a compressed-tensors NVFP4 config; ``ConfigError`` names the bad field."""
    groups = config.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ConfigError(f"config_groups is {groups!r}; an NVFP4 checkpoint needs at least one "
                          "group")
    status = config.get("quantization_status")
    if status is not None and status != "compressed":
        raise ConfigError(f"quantization_status is {status!r}; this format reads 'compressed' "
                          "checkpoints (packed weights)")
    top_format = config.get("format")
    parsed = []
    for name, group in sorted(groups.items()):
        where = f"config_groups[{name!r}]"
        if not isinstance(group, dict):
            raise ConfigError(f"{where} must be a mapping, got {group!r}")
        fmt = group.get("format") or top_format
        if fmt != PACKED_FORMAT:
            raise ConfigError(f"{where} has format {fmt!r}; this format reads "
                              f"{PACKED_FORMAT!r} only")
        _check_args(group.get("weights"), f"{where}.weights")
        acts = group.get("input_activations")
        if acts is not None:
            _check_args(acts, f"{where}.input_activations")
        targets = _patterns(group.get("targets"), f"{where}.targets")
        if not targets:
            raise ConfigError(f"{where}.targets is empty; a group must target some modules")
        parsed.append(CtGroup(name, targets, acts is not None))
    return CtConfig(tuple(parsed), _patterns(config.get("ignore"), "ignore"))


class CompressedTensorsNvfp4Format(CheckpointFormat):
    """llm-compressor's compressed-tensors NVFP4 (``nvfp4-pack-quantized``): packed E2M1
    weights, E4M3 block scales and reciprocal global scales converted to ModelOpt's."""

    name: ClassVar[str] = "compressed-tensors-nvfp4"
    api_version: ClassVar[str] = "1.0"
    priority: ClassVar[int] = 10
    summary: ClassVar[str] = "compressed-tensors nvfp4-pack-quantized checkpoints (llm-compressor)"

    @classmethod
    def can_implement(cls, request: FormatRequest, device: DeviceCapability) -> Verdict:
        del device  # reading a config does not depend on the device
        if request.quant_method != "compressed-tensors":
            return Verdict.handles(False, f"reads quant_method 'compressed-tensors', this "
                                   f"checkpoint declares {request.describe()}")
        try:
            parsed = parse_compressed_tensors(request.config)
        except ConfigError as exc:
            return Verdict.reject(f"compressed-tensors config: {exc}")
        kinds = sorted({"W4A4" if g.w4a4 else "W4A16" for g in parsed.groups})
        return Verdict.accept(f"{PACKED_FORMAT}, {'/'.join(kinds)}")

    def __init__(self, request: FormatRequest) -> None:
        super().__init__(request)
        self.parsed = parse_compressed_tensors(request.config)

    def _explain(self, module: str) -> tuple[QuantScheme, str]:
        if is_never_quantized(module):
            return UNQUANTIZED, "lm_head, embeddings and MoE routers stay unquantized"
        for entry in self.parsed.ignore:
            if ct_match_level(module, entry):
                return UNQUANTIZED, f"ignored by {entry!r}"
        best: list[tuple[int, CtGroup, str]] = []
        for group in self.parsed.groups:
            level, target = max((ct_match_level(module, t), t) for t in group.targets)
            if level == 0:
                continue
            if best and level < best[0][0]:
                continue
            if best and level > best[0][0]:
                best.clear()
            best.append((level, group, target))
        if not best:
            return UNQUANTIZED, "no config group targets it"
        if len(best) > 1:
            named = ", ".join(f"{g.name!r} (target {t!r})" for _, g, t in best)
            raise ConfigError(f"module {module!r} is targeted equally by config groups {named}; "
                              "exactly one group must match it most specifically")
        _, group, target = best[0]
        return nvfp4_scheme("compressed-tensors", group.w4a4), (
            f"config_groups[{group.name!r}] targets it with {target!r}")

    def explain(self, module: str) -> tuple[QuantScheme, str]:
        """The scheme of ``module`` and why; a fused module takes its shards' common scheme
        (``ConfigError`` naming each shard when they differ)."""
        shards = fused_shards(module)
        if not shards:
            return self._explain(module)
        found = {s: self._explain(s) for s in shards}
        if len({scheme for scheme, _ in found.values()}) > 1:
            detail = "; ".join(f"{s}: {sc.describe()} ({why})" for s, (sc, why) in found.items())
            raise ConfigError(f"fused module {module!r} has shards with different schemes, "
                              f"which cannot share one weight: {detail}")
        return next(iter(found.values()))

    def scheme_for(self, module: str) -> QuantScheme:
        return self.explain(module)[0]

    def source_name(self, module: str, tensor: str) -> str:
        # A MoE method names per-expert tensors relative to the block ("experts.5.gate_proj.
        # weight" under "model.layers.3.mlp"): only the last component is the dialect's.
        prefix, _, leaf = tensor.rpartition(".")
        owner = f"{module}.{prefix}" if prefix else module
        return f"{owner}.{CT_TENSOR_NAMES.get(leaf, leaf)}"

    def convert(self, module: str, tensor: str, value: torch.Tensor) -> torch.Tensor:
        """Global scales: compressed-tensors stores ``(6*448)/amax`` as fp32 ``[1]``; the
        canonical ``weight_scale_2``/``input_scale`` is its reciprocal, a 0-d fp32. Per-expert
        names (``experts.5.gate_proj.input_scale``) convert by their last component."""
        del module
        leaf = tensor.rpartition(".")[2]
        if leaf not in _RECIPROCAL:
            return value
        from kernelbay.formats import compressed_tensors_global_scale

        if value.numel() != 1:
            raise ValueError(f"{CT_TENSOR_NAMES[leaf]} of {tensor!r} has shape "
                             f"{list(value.shape)}; a global scale is one value")
        return compressed_tensors_global_scale(value).reshape(())

    def linear_modules(self, tensors: Mapping[str, TensorInfo]) -> Sequence[LinearModule]:
        """Packed layers (``<module>.weight_packed``, K = 2 x the packed width) and plain
        ``<module>.weight`` layers, each checked against its scheme."""
        from kernelbay.checkpoint import linear_role

        found = []
        for module in super().linear_modules(tensors):
            scheme, why = self.explain(module.name)
            found.append(check_linear(module, scheme, tensors, f"{module.name}.weight",
                                      self._names(module.name), why))
        suffix = "." + CT_TENSOR_NAMES["weight"]
        for name, info in tensors.items():
            if not name.endswith(suffix) or len(info.shape) != 2:
                continue
            module_name = name[: -len(suffix)]
            scheme, why = self.explain(module_name)
            if scheme.name != "nvfp4":
                raise CheckpointError(info.file, f"is a packed NVFP4 weight, but the config "
                                      f"leaves {module_name!r} unquantized ({why})", tensor=name)
            module = LinearModule(module_name, info.shape[1], info.shape[0],
                                  f"{module_name}.bias" in tensors, linear_role(module_name),
                                  info.dtype)
            found.append(check_linear(module, scheme, tensors, name, self._names(module_name),
                                      why))
        return sorted(found, key=lambda m: m.name)

    def _names(self, module: str) -> dict[str, str]:
        return {t: self.source_name(module, t) for t in ("weight_scale", "weight_scale_2")}
