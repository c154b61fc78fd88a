"""The engine: load a checkpoint through the hooks and generate (imports torch)."""

from kernelbay.engine.kv_cache import KVCacheConfig
from kernelbay.engine.llm import LLM, RequestOutput
from kernelbay.engine.sampling import SamplingParams
from kernelbay.engine.speculative import SpeculativeConfig

__all__ = ["LLM", "KVCacheConfig", "RequestOutput", "SamplingParams", "SpeculativeConfig"]
