"""Base classes of the five backend kinds, and the core's plain-torch reference backends.

Importing this package imports no torch: the references import it when they run.
"""

from kernelbay.layers.attention import (
    AttentionBackend,
    AttentionMetadata,
    KVCacheLayout,
    visible_keys,
)
from kernelbay.layers.checkpoint_format import CheckpointFormat, LinearModule
from kernelbay.layers.collective import Collective
from kernelbay.layers.device_probe import DeviceProbe
from kernelbay.layers.linear import LinearMethod, TensorSpec
from kernelbay.layers.moe import MOE_EXPERTS_ROLE, MoEMethod
from kernelbay.layers.proposer import DraftBuffers, DraftLogitsSpec, Proposer

__all__ = [
    "MOE_EXPERTS_ROLE",
    "AttentionBackend",
    "AttentionMetadata",
    "CheckpointFormat",
    "Collective",
    "DeviceProbe",
    "DraftBuffers",
    "DraftLogitsSpec",
    "KVCacheLayout",
    "LinearMethod",
    "LinearModule",
    "MoEMethod",
    "Proposer",
    "TensorSpec",
    "visible_keys",
]
