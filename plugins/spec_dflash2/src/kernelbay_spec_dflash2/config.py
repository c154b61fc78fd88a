"""The drafter's configuration and its on-disk form (``config.json``), torch-free.

A drafter folder holds exactly two files: ``config.json`` (``DFlash2Config.to_dict()``) and
``model.safetensors`` (the state dict). ``can_implement`` reads the JSON only, so choosing the
proposer never imports torch.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from typing import Any, final

__all__ = [
    "CONFIG_NAME",
    "FORMAT_VERSION",
    "MODEL_TYPE",
    "WEIGHTS_NAME",
    "DFlash2Config",
    "read_drafter_config",
]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
#: ``model_type`` written into a drafter's config.json.
MODEL_TYPE = "dflash2"
#: Version of the folder layout; bumped when the state-dict names or config keys change.
FORMAT_VERSION = 1

# Keys written for identification only; they are not constructor arguments.
_MARKER_KEYS = ("model_type", "architectures", "dflash2_format")


@final
@dataclass(frozen=True)
class DFlash2Config:
    """Shape of one DFlash2 drafter and the target it was trained for.

    ``target_layer_ids`` index the tuple of hidden states a Hugging Face model returns with
    ``output_hidden_states=True`` (0 = embeddings, i = output of decoder layer i); their
    features are concatenated and projected to ``hidden_size``. ``block_size`` (k) tokens
    are drafted per forward pass; the selector keeps ``num_candidates`` (c) tokens per slot
    and scores adjacent pairs with a rank-``pair_rank`` bilinear term. ``context_window`` is
    how many of the latest target positions the drafter attends to.
    """

    target_model_type: str
    target_hidden_size: int
    vocab_size: int
    target_layer_ids: tuple[int, ...] = (1,)
    hidden_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 512
    block_size: int = 8
    num_candidates: int = 16
    pair_rank: int = 16
    conv_groups: int = 8
    context_window: int = 32
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        positive = ("target_hidden_size", "vocab_size", "hidden_size", "num_layers", "num_heads",
                    "intermediate_size", "block_size", "num_candidates", "pair_rank",
                    "conv_groups", "context_window")
        bad = {n: getattr(self, n) for n in positive if int(getattr(self, n)) < 1}
        if bad:
            raise ValueError(f"DFlash2Config fields must be >= 1, got {bad}")
        if not self.target_layer_ids:
            raise ValueError("DFlash2Config.target_layer_ids must name at least one target "
                             "layer, got ()")
        if any(i < 0 for i in self.target_layer_ids):
            raise ValueError(f"DFlash2Config.target_layer_ids must be >= 0, got "
                             f"{self.target_layer_ids}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not a multiple of "
                             f"num_heads={self.num_heads}")
        if self.hidden_size % self.conv_groups:
            raise ValueError(f"hidden_size={self.hidden_size} is not a multiple of "
                             f"conv_groups={self.conv_groups}")
        if self.num_candidates > self.vocab_size:
            raise ValueError(f"num_candidates={self.num_candidates} exceeds "
                             f"vocab_size={self.vocab_size}")

    @property
    def context_features(self) -> int:
        """Width of the concatenated target features: layers x target hidden size."""
        return len(self.target_layer_ids) * self.target_hidden_size

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict, with the identification keys a drafter folder carries."""
        data = asdict(self)
        data["target_layer_ids"] = list(self.target_layer_ids)
        data.update(model_type=MODEL_TYPE, architectures=["DFlash2Drafter"],
                    dflash2_format=FORMAT_VERSION)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DFlash2Config:
        """Parse ``to_dict()``'s output; unknown keys and a foreign ``model_type`` are errors."""
        if data.get("model_type", MODEL_TYPE) != MODEL_TYPE:
            raise ValueError(f"config model_type is {data.get('model_type')!r}, a DFlash2 "
                             f"drafter has {MODEL_TYPE!r}")
        version = data.get("dflash2_format", FORMAT_VERSION)
        if version != FORMAT_VERSION:
            raise ValueError(f"drafter folder format {version!r} is not supported; this "
                             f"plugin reads format {FORMAT_VERSION}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names - set(_MARKER_KEYS))
        if unknown:
            raise ValueError(f"unknown DFlash2 config keys {unknown}; valid keys: {sorted(names)}")
        kwargs = {k: v for k, v in data.items() if k in names}
        if "target_layer_ids" in kwargs:
            kwargs["target_layer_ids"] = tuple(kwargs["target_layer_ids"])
        return cls(**kwargs)

    def to_json(self) -> str:
        """The ``config.json`` text."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"


def read_drafter_config(folder: str) -> DFlash2Config:
    """Read ``folder/config.json``; raises ``FileNotFoundError`` or ``ValueError`` with the path."""
    path = os.path.join(folder, CONFIG_NAME)
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, found {type(data).__name__}")
    try:
        return DFlash2Config.from_dict(data)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from exc
