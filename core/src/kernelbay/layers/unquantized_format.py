"""The always-available format for checkpoints with no quantization config."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from kernelbay._version import PLUGIN_API_VERSION
from kernelbay.layers.checkpoint_format import CheckpointFormat
from kernelbay.requests import UNQUANTIZED, FormatRequest, QuantScheme
from kernelbay.verdict import Verdict

if TYPE_CHECKING:
    from kernelbay.device import DeviceCapability

__all__ = ["UnquantizedFormat"]


class UnquantizedFormat(CheckpointFormat):
    """Plain floating-point checkpoints (no ``quantization_config``): every layer unquantized."""

    name: ClassVar[str] = "unquantized"
    api_version: ClassVar[str] = PLUGIN_API_VERSION
    priority: ClassVar[int] = 0
    summary: ClassVar[str] = "checkpoints with no quantization config"

    @classmethod
    def can_implement(cls, request: FormatRequest, device: DeviceCapability) -> Verdict:
        return Verdict.handles(request.quant_method is None,
                             f"reads checkpoints without a quantization config, this one "
                             f"declares {request.describe()}")

    def scheme_for(self, module: str) -> QuantScheme:
        return UNQUANTIZED
