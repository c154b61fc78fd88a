"""Checkpoint formats: recognise a quantization config and give each layer its scheme."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, final

from kernelbay.backend import Backend
from kernelbay.kinds import BackendKind
from kernelbay.requests import FormatRequest, QuantScheme

if TYPE_CHECKING:
    import torch

    from kernelbay.checkpoint.folder import CheckpointFolder
    from kernelbay.checkpoint.tensors import TensorInfo

__all__ = ["CheckpointFormat", "LinearModule"]


@final
@dataclass(frozen=True)
class LinearModule:
    """A linear layer found in a checkpoint, with its logical (unpacked) shape."""

    name: str
    in_features: int
    out_features: int
    bias: bool
    role: str
    dtype: str


class CheckpointFormat(Backend[FormatRequest]):
    """Reads one family of checkpoints; ``can_implement`` says whether it recognises the
    quantization config, and an instance (built on that request) answers per layer."""

    kind: ClassVar[BackendKind] = BackendKind.CHECKPOINT_FORMAT
    #: Output formats ``write`` produces (``kernelbay quantize --format NAME``), e.g.
    #: ``("modelopt-nvfp4",)``. Empty: this handler only reads.
    writes: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def write(cls, source: CheckpointFolder, destination: str, output_format: str, *,
              progress: bool = False) -> None:
        """Quantize the unquantized checkpoint ``source`` into the empty folder
        ``destination`` in ``output_format`` (one of ``writes``): every tensor file and the
        config, exactly as the producer's own exporter names, shapes and types them. The core
        copies the tokenizer and generation config and makes the result appear atomically."""
        raise NotImplementedError(f"{cls.__qualname__} writes no format")

    def __init__(self, request: FormatRequest) -> None:
        self.request = request

    def scheme_for(self, module: str) -> QuantScheme:
        """The quant scheme of the linear layer ``module`` (unquantized for excluded layers)."""
        raise NotImplementedError(f"{type(self).__qualname__} does not implement scheme_for")

    def linear_modules(self, tensors: Mapping[str, TensorInfo]) -> Sequence[LinearModule]:
        """The linear layers among ``tensors`` (default: each 2-D ``<module>.weight`` that is
        not an embedding), with their logical shapes."""
        from kernelbay.checkpoint.layout import plain_linear_modules

        return plain_linear_modules(tensors)

    def source_name(self, module: str, tensor: str) -> str:
        """Checkpoint name of a layer's canonical tensor (``weight``, ``weight_scale`` ...).

        Linear methods name their tensors canonically; a dialect whose files use other names
        (``weight_packed``, ``weight_scale_inv``) maps them here. Default: ``module.tensor``.
        """
        return f"{module}.{tensor}"

    def convert(self, module: str, tensor: str, value: torch.Tensor) -> torch.Tensor:
        """Bring a loaded tensor to the canonical convention (e.g. a reciprocal global scale).
        Default: unchanged."""
        del module, tensor
        return value
