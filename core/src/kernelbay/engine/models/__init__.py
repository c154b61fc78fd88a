"""Model families the engine runs, by the ``architectures`` name in ``config.json``."""

from __future__ import annotations

import importlib
from typing import Any

from kernelbay.errors import ConfigError

__all__ = ["SUPPORTED_ARCHITECTURES", "model_class"]

#: architecture -> "module:class", imported when a model of that family is built.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "kernelbay.engine.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "kernelbay.engine.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "kernelbay.engine.models.llama:LlamaForCausalLM",
    "DeepseekV3ForCausalLM": "kernelbay.engine.models.deepseek_v3:DeepseekV3ForCausalLM",
}


def model_class(architectures: list[str], config_path: str) -> Any:
    """The model class for a config's ``architectures``; ``ConfigError`` lists the valid set."""
    for name in architectures:
        target = SUPPORTED_ARCHITECTURES.get(name)
        if target is not None:
            module, cls = target.split(":")
            return getattr(importlib.import_module(module), cls)
    raise ConfigError(f"{config_path}: architectures {architectures!r} are not supported; "
                      f"supported: {sorted(SUPPORTED_ARCHITECTURES)}")
