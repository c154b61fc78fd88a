"""Reading checkpoints: typed JSON configs and safetensors headers (no code is executed)."""

from kernelbay.checkpoint.config import HFQuantConfig, ModelConfig, SafetensorsIndex
from kernelbay.checkpoint.folder import CheckpointFolder
from kernelbay.checkpoint.layout import collapse_index, linear_role
from kernelbay.checkpoint.tensors import TensorInfo, read_safetensors_header

__all__ = [
    "CheckpointFolder",
    "HFQuantConfig",
    "ModelConfig",
    "SafetensorsIndex",
    "TensorInfo",
    "collapse_index",
    "linear_role",
    "read_safetensors_header",
]
