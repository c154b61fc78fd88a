"""The core's own plugin: the always-available plain-torch reference backends."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kernelbay._version import PLUGIN_API_VERSION
from kernelbay.hookspecs import hookimpl

if TYPE_CHECKING:
    from kernelbay.layers import (
        AttentionBackend,
        CheckpointFormat,
        Collective,
        LinearMethod,
        Proposer,
    )

KERNELBAY_PLUGIN_API = PLUGIN_API_VERSION


@hookimpl
def kernelbay_checkpoint_formats() -> Sequence[type[CheckpointFormat]]:
    """The unquantized format."""
    from kernelbay.layers.unquantized_format import UnquantizedFormat

    return [UnquantizedFormat]


@hookimpl
def kernelbay_linear_methods() -> Sequence[type[LinearMethod]]:
    """The unquantized and FP8 reference linears, and the unquantized and FP8 routed-expert
    MLPs."""
    from kernelbay.layers.moe import TorchFp8MoE, TorchMoE
    from kernelbay.layers.torch_fp8_linear import TorchFp8DequantLinear
    from kernelbay.layers.torch_linear import TorchUnquantizedLinear

    return [TorchUnquantizedLinear, TorchFp8DequantLinear, TorchMoE, TorchFp8MoE]


@hookimpl
def kernelbay_attention_backends() -> Sequence[type[AttentionBackend]]:
    """Paged attention (MHA/GQA/MQA) and absorbed MLA attention in plain torch."""
    from kernelbay.layers.torch_attention import TorchPagedAttention
    from kernelbay.layers.torch_mla import TorchMLAAttention

    return [TorchPagedAttention, TorchMLAAttention]


@hookimpl
def kernelbay_proposers() -> Sequence[type[Proposer]]:
    """The n-gram (prompt lookup) proposer."""
    from kernelbay.layers.ngram_proposer import NGramProposer

    return [NGramProposer]


@hookimpl
def kernelbay_collectives() -> Sequence[type[Collective]]:
    """torch.distributed collectives."""
    from kernelbay.layers.torch_collectives import TorchDistributedCollective

    return [TorchDistributedCollective]
