"""``hf-fp8``: Hugging Face fine-grained FP8 checkpoints (``quant_method: "fp8"``).

The dialect of transformers' ``FineGrainedFP8Config`` (DeepSeek-V3, Qwen3-FP8, MiniMax ...)::

    "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128],
                            "modules_to_not_convert": ["lm_head", ...]}

Tensors per quantized linear: ``weight`` float8_e4m3fn [N, K] and ``weight_scale_inv``
float32 [ceil(N/bn), ceil(K/bk)] -- despite its name already the dequant *multiplier*, so it
maps to the canonical ``weight_scale`` by name only (``source_name``), no reciprocal. Without
``weight_block_size`` the scale is one float32 per tensor. Schemes: ``fp8-block`` with
``group_shape = weight_block_size`` (or ``fp8`` per-tensor), dialect ``hf-fp8``, activation
``fp8-dynamic`` (transformers quantizes activations per 1 x bk group on the fly; weight-only
kernels keep them bf16) or ``fp8-static`` for ``activation_scheme: "static"``, whose
per-tensor ``activation_scale`` maps to the canonical ``input_scale``.

Unquantized layers: those ``modules_to_not_convert`` (alias ``ignored_layers``) names, matched
as transformers does (prefix up to a module boundary, regular expression with the same
boundary, or suffix), and any linear whose checkpoint has no ``weight_scale_inv`` (DeepSeek-V3
writes no exclusion list; its ``lm_head`` and router ``gate`` are simply bf16).

Orientation: ``linear_modules`` compares each scale grid with its weight's shape; a grid that
only fits the transposed weight marks an exporter that wrote [K, N], and the layer's scheme
gets the option ``weight_layout = "kn"`` (linear methods of this plugin read it). This needs
blocks that are not square (e.g. 32 x 128, or 1 x 128 per row): with square blocks a [K, N]
weight and its grid are indistinguishable from an [N, K] one by shapes alone, and the layer is
taken as [N, K], the Hugging Face convention (the engine then reports a logical-shape
mismatch against the architecture, naming the tensor).

Writing: ``kernelbay quantize --format fp8`` (and ``kernelbay run --quantize fp8``) writes
this dialect with 128 x 128 blocks; see ``hf_fp8_writer``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from kernelbay.layers.checkpoint_format import CheckpointFormat, LinearModule
from kernelbay.requests import UNQUANTIZED, FormatRequest, QuantScheme
from kernelbay.verdict import Verdict

if TYPE_CHECKING:
    from kernelbay.checkpoint.folder import CheckpointFolder
    from kernelbay.checkpoint.tensors import TensorInfo
    from kernelbay.device import DeviceCapability

__all__ = ["HfFp8Format", "hf_fp8_excluded"]

_ACTIVATION_SCHEMES = {"dynamic": "fp8-dynamic", "static": "fp8-static"}
_SOURCE_NAMES = {"weight_scale": "weight_scale_inv", "input_scale": "activation_scale"}
_BOUNDARY = r"(?:(?<=\.)|(?=\.|$))"


def hf_fp8_excluded(module: str, patterns: Sequence[str] | None) -> bool:
    """True when ``module`` matches a ``modules_to_not_convert`` entry, by transformers' rule:
    ``re.match(pattern + boundary)`` (so ``layers.1`` covers ``layers.1.mlp`` but not
    ``layers.11``, and ``layers.*`` is a regex) or a plain suffix (``lm_head``)."""
    for pattern in patterns or ():
        try:
            if re.match(rf"(?:{pattern}){_BOUNDARY}", module):
                return True
        except re.error:
            pass  # not a valid regex: only the suffix rule applies
        if module.endswith(pattern):
            return True
    return False


def _block(config: Mapping[str, Any]) -> tuple[int, int] | str | None:
    """``(bn, bk)``, ``None`` (per-tensor), or a sentence saying what is wrong."""
    raw = config.get("weight_block_size")
    if raw is None:
        return None
    if (not isinstance(raw, (list, tuple)) or len(raw) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in raw)):
        return f"weight_block_size must be two positive integers [bn, bk], config has {raw!r}"
    return int(raw[0]), int(raw[1])


class HfFp8Format(CheckpointFormat):
    """Hugging Face fine-grained FP8 checkpoints (``quant_method: "fp8"``): E4M3 weights with
    ``weight_scale_inv`` multipliers per ``weight_block_size`` tile (or per tensor)."""

    name: ClassVar[str] = "hf-fp8"
    api_version: ClassVar[str] = "1.0"
    priority: ClassVar[int] = 0
    summary: ClassVar[str] = ("Hugging Face fine-grained FP8 (quant_method 'fp8', "
                              "weight_scale_inv, weight_block_size); writes 'fp8'")
    writes: ClassVar[tuple[str, ...]] = ("fp8",)

    @classmethod
    def write(cls, source: CheckpointFolder, destination: str, output_format: str, *,
              progress: bool = False) -> None:
        """Quantize ``source`` to the fine-grained FP8 dialect with 128 x 128 blocks, as
        DeepSeek-V3's release lays it out (``hf_fp8_writer``)."""
        if output_format not in cls.writes:
            raise ValueError(f"{cls.name} writes {list(cls.writes)}, asked for "
                             f"{output_format!r}")
        from kernelbay_cpu_amx.hf_fp8_writer import write_hf_fp8

        write_hf_fp8(source, destination, progress=progress)

    def __init__(self, request: FormatRequest) -> None:
        super().__init__(request)
        self.config = request.config
        block = _block(self.config)
        if isinstance(block, str):
            raise ValueError(block)
        self.block = block
        self.activation = _ACTIVATION_SCHEMES[str(self.config.get("activation_scheme",
                                                                   "dynamic")).lower()]
        self.excluded = list(self.config.get("modules_to_not_convert")
                             or self.config.get("ignored_layers") or [])
        # Filled by linear_modules (the loader calls it before scheme_for).
        self._scaled: set[str] | None = None
        self._transposed: set[str] = set()

    @classmethod
    def can_implement(cls, request: FormatRequest, device: DeviceCapability) -> Verdict:
        del device  # a checkpoint's dialect does not depend on the device
        if request.quant_method != "fp8":
            return Verdict.handles(False, f"reads quant_method 'fp8' (Hugging Face fine-grained "
                                          f"FP8), checkpoint has {request.describe()}")
        config = request.config
        block = _block(config)
        activation = str(config.get("activation_scheme", "dynamic")).lower()
        scale_fmt = config.get("scale_fmt", "float")
        expert_dtype = config.get("expert_dtype", "fp8")
        fmt = config.get("fmt", "e4m3")
        return Verdict.all(
            Verdict.check(not isinstance(block, str), str(block)),
            Verdict.check(activation in _ACTIVATION_SCHEMES,
                          f"needs activation_scheme in {sorted(_ACTIVATION_SCHEMES)}, config "
                          f"has {activation!r}"),
            Verdict.check(scale_fmt in (None, "float"),
                          f"reads float32 weight scales (scale_fmt 'float'), config has "
                          f"scale_fmt {scale_fmt!r}"),
            Verdict.check(expert_dtype in (None, "fp8"),
                          f"reads FP8 experts (expert_dtype 'fp8'), config has {expert_dtype!r}"),
            Verdict.check(fmt in (None, "e4m3"),
                          f"reads E4M3 weights (fmt 'e4m3'), config has fmt {fmt!r}"),
        )

    def linear_modules(self, tensors: Mapping[str, TensorInfo]) -> Sequence[LinearModule]:
        """Plain linear modules with logical [N, K] shapes; records which carry scales and
        which were written transposed (see the module docstring)."""
        from kernelbay.checkpoint.layout import plain_linear_modules

        self._scaled = set()
        found = []
        for module in plain_linear_modules(tensors):
            scale = tensors.get(self.source_name(module.name, "weight_scale"))
            if scale is not None:
                self._scaled.add(module.name)
                rows, cols = module.out_features, module.in_features
                if self.block is not None and self._is_transposed(rows, cols, scale.shape):
                    self._transposed.add(module.name)
                    module = LinearModule(module.name, rows, cols, module.bias, module.role,
                                          module.dtype)
            found.append(module)
        return found

    def _is_transposed(self, rows: int, cols: int, scale_shape: tuple[int, ...]) -> bool:
        assert self.block is not None
        bn, bk = self.block
        as_nk = (-(-rows // bn), -(-cols // bk))
        as_kn = (-(-rows // bk), -(-cols // bn))
        return as_nk != as_kn and tuple(scale_shape) == as_kn

    def scheme_for(self, module: str) -> QuantScheme:
        if hf_fp8_excluded(module, self.excluded):
            return UNQUANTIZED
        if self._scaled is not None and module not in self._scaled:
            return UNQUANTIZED
        options: tuple[tuple[str, str], ...] = ()
        if module in self._transposed:
            options = (("weight_layout", "kn"),)
        if self.block is None:
            return QuantScheme("fp8", "float8_e4m3fn", None, "float32", False, self.activation,
                               "hf-fp8", options)
        return QuantScheme("fp8-block", "float8_e4m3fn", self.block, "float32", False,
                           self.activation, "hf-fp8", options)

    def source_name(self, module: str, tensor: str) -> str:
        # A routed-expert method names its tensors relative to the MoE block
        # ("experts.5.gate_proj.weight_scale"): only the last component is renamed.
        head, _, leaf = tensor.rpartition(".")
        leaf = _SOURCE_NAMES.get(leaf, leaf)
        return f"{module}.{head}.{leaf}" if head else f"{module}.{leaf}"
