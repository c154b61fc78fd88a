"""AMD Quark checkpoints (``quant_method: "quark"``): OCP MXFP4 and FP8 per-tensor layers.

See ``quark_config`` for how the config is read and matched, and ``quark_names`` for how
scale tensors are assigned to layer parameters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, ClassVar

from kernelbay.errors import CheckpointError, ConfigError
from kernelbay.layers.checkpoint_format import CheckpointFormat, LinearModule
from kernelbay.requests import FormatRequest, QuantScheme
from kernelbay.verdict import Verdict

from kernelbay_quant_mxfp4_rocm.quark_config import MX_GROUP, parse_quark
from kernelbay_quant_mxfp4_rocm.quark_names import match_scale_tensors

if TYPE_CHECKING:
    import torch
    from kernelbay.checkpoint.folder import CheckpointFolder
    from kernelbay.checkpoint.tensors import TensorInfo
    from kernelbay.device import DeviceCapability

__all__ = ["QuarkFormat"]

_FLOAT_DTYPES = ("float32", "bfloat16", "float16")
_E8M0_DTYPES = ("uint8", "float8_e8m0fnu")


class QuarkFormat(CheckpointFormat):
    """AMD Quark exports: OCP MXFP4 weights (E2M1 + E8M0 per 32) with dynamic MXFP4/MXFP8 or
    no activation quantization, and FP8 per-tensor layers; exclude, then layer patterns, then
    layer type, then global config."""

    name: ClassVar[str] = "quark"
    api_version: ClassVar[str] = "1.0"
    priority: ClassVar[int] = 10
    summary: ClassVar[str] = "AMD Quark checkpoints (OCP MXFP4, FP8 per-tensor)"
    #: ``kernelbay quantize --format quark-mxfp4``: what amd-quark's ``export_safetensors``
    #: writes for its ``mxfp4`` template scheme (``quark_writer``).
    writes: ClassVar[tuple[str, ...]] = ("quark-mxfp4",)

    @classmethod
    def write(cls, source: CheckpointFolder, destination: str, output_format: str, *,
              progress: bool = False) -> None:
        """Quantize ``source`` into ``destination`` as Quark MXFP4 W4A4 (dynamic MXFP4
        activations, scale rule ``even``); see ``quark_writer``."""
        if output_format not in cls.writes:
            raise ConfigError(f"{cls.name} writes {list(cls.writes)}, not {output_format!r}")
        from kernelbay_quant_mxfp4_rocm.quark_writer import write_quark_mxfp4

        write_quark_mxfp4(source, destination, progress=progress)

    @classmethod
    def can_implement(cls, request: FormatRequest, device: DeviceCapability) -> Verdict:
        del device  # reading a config does not depend on the device
        if request.quant_method != "quark":
            return Verdict.handles(False, f"reads quant_method 'quark', this checkpoint "
                                   f"declares {request.describe()}")
        try:
            parsed = parse_quark(request.config)
        except ConfigError as exc:
            return Verdict.reject(f"Quark config: {exc}")
        return Verdict.accept(f"global {parsed.global_layer.scheme.describe()}")

    def __init__(self, request: FormatRequest) -> None:
        super().__init__(request)
        self.parsed = parse_quark(request.config)
        # (module, parameter) -> checkpoint name, for scales stored under another name;
        # filled by linear_modules, which the loader calls before reading tensors.
        self._sources: dict[tuple[str, str], str] = {}

    def explain(self, module: str) -> tuple[QuantScheme, str]:
        """The scheme of ``module`` and which config entry decided it."""
        return self.parsed.resolve(module)

    def scheme_for(self, module: str) -> QuantScheme:
        return self.parsed.resolve(module)[0]

    def source_name(self, module: str, tensor: str) -> str:
        # A MoE method names per-expert tensors relative to the block ("experts.5.gate_proj.
        # weight_scale" under "model.layers.3.mlp"): the owner is the expert's projection.
        prefix, _, leaf = tensor.rpartition(".")
        owner = f"{module}.{prefix}" if prefix else module
        return self._sources.get((owner, leaf), f"{owner}.{leaf}")

    def convert(self, module: str, tensor: str, value: torch.Tensor) -> torch.Tensor:
        """E8M0 scales stored as ``float8_e8m0fnu`` are reinterpreted as their uint8 bytes,
        the canonical MX scale dtype (per-expert names convert by their last component)."""
        del module
        if (tensor.rpartition(".")[2] == "weight_scale"
                and str(value.dtype) == "torch.float8_e8m0fnu"):
            import torch

            return value.view(torch.uint8)
        return value

    def linear_modules(self, tensors: Mapping[str, TensorInfo]) -> Sequence[LinearModule]:
        """Each ``<module>.weight`` linear layer with its logical shape (K = 2 x the packed
        width of MXFP4 weights), checked against its scheme; every scale tensor must belong
        to one of them (``quark_names.match_scale_tensors``)."""
        modules = list(super().linear_modules(tensors))
        matched = match_scale_tensors(tensors, (m.name for m in modules))
        self._sources = {owner: name for name, owner in matched.items()
                         if name != f"{owner[0]}.{owner[1]}"}
        return [self._check(m, tensors) for m in modules]

    def _check(self, module: LinearModule, tensors: Mapping[str, TensorInfo]) -> LinearModule:
        scheme, why = self.explain(module.name)
        weight_name = f"{module.name}.weight"
        w = tensors[weight_name]
        n, cols = w.shape
        if not scheme.is_quantized:
            if w.dtype not in _FLOAT_DTYPES:
                raise CheckpointError(w.file, f"is stored as {w.dtype}, but the config leaves "
                                      f"this layer unquantized ({why})", tensor=weight_name)
            return module
        expect = "uint8" if scheme.name == "mxfp4" else "float8_e4m3fn"
        if w.dtype != expect:
            raise CheckpointError(w.file, f"is stored as {w.dtype}, but the config quantizes "
                                  f"this layer as {scheme.describe()} ({why}); expected "
                                  f"{expect}", tensor=weight_name)
        scale_name = self.source_name(module.name, "weight_scale")
        scale = tensors.get(scale_name)
        if scale is None:
            raise CheckpointError(w.file, f"is missing; {scheme.name} layer {module.name!r} "
                                  "needs its weight scales", tensor=scale_name)
        if scheme.name == "fp8":
            if scale.numel != 1:
                raise CheckpointError(scale.file, f"has shape {list(scale.shape)}, but FP8 "
                                      "per-tensor needs one scale", tensor=scale_name)
            return module
        k = 2 * cols
        want = (n, -(-k // MX_GROUP))
        if scale.dtype not in _E8M0_DTYPES or scale.shape != want:
            raise CheckpointError(scale.file, f"is {scale.dtype} {list(scale.shape)}, but MXFP4 "
                                  f"weight [{n}, {cols}] (K={k}) needs E8M0 bytes "
                                  f"{list(want)} (uint8 or float8_e8m0fnu)", tensor=scale_name)
        return replace(module, in_features=k)
