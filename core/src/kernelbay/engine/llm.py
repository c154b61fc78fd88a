"""The Python API: ``LLM(model).generate(prompts, SamplingParams)`` and ``LLM.logits``."""

from __future__ import annotations

import json
import os
import time
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, replace
from typing import Any, final

import torch

from kernelbay.checkpoint.folder import CheckpointFolder
from kernelbay.device import DeviceCapability
from kernelbay.engine.build import ModelBuilder
from kernelbay.engine.graphs import DecodeGraphs, graphs_enabled
from kernelbay.engine.kv_cache import KVCacheConfig, PagedKVCache, pages_for
from kernelbay.engine.loader import load_weights
from kernelbay.engine.models import model_class
from kernelbay.engine.modules import RMSNorm, VocabParallelEmbedding
from kernelbay.engine.parallel import init_tensor_parallel
from kernelbay.engine.runner import ModelRunner, Sequence
from kernelbay.engine.sampling import SamplingParams, sample_tokens
from kernelbay.engine.speculative import SpeculativeConfig, SpeculativeDecoder
from kernelbay.errors import ConfigError
from kernelbay.kinds import BackendKind
from kernelbay.layers import Proposer
from kernelbay.plan import Decision, Plan
from kernelbay.plugins import Registry, get_registry
from kernelbay.policy import Policy
from kernelbay.requests import CollectiveRequest, ProposerRequest
from kernelbay.select import select

__all__ = ["LLM", "RequestOutput"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@final
@dataclass
class RequestOutput:
    """One finished request: generated ids and text, why it stopped, and per-step times."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    step_times: list[float] = field(default_factory=list)
    steps: int = 0

    @property
    def accepted_length(self) -> float:
        """Generated tokens per target forward pass (1 without speculation)."""
        return len(self.token_ids) / self.steps if self.steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per second of this request's steps."""
        total = sum(self.step_times)
        return len(self.token_ids) / total if total > 0 else 0.0


def _resolve_dtype(dtype: str | torch.dtype | None, config_dtype: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype or config_dtype
    if name not in _DTYPES:
        raise ConfigError(f"dtype {name!r} is not supported; valid: {sorted(_DTYPES)}")
    return _DTYPES[name]


def _eos_ids(folder: CheckpointFolder) -> tuple[int, ...]:
    ids: Any = None
    path = folder.file("generation_config.json")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            ids = json.load(f).get("eos_token_id")
    if ids is None:
        ids = (folder.config.model_extra or {}).get("eos_token_id")
    if ids is None:
        return ()
    return tuple(ids) if isinstance(ids, list) else (int(ids),)


class LLM:
    """A checkpoint loaded on selected backends, ready to generate.

    ``model`` is a local checkpoint folder. ``device`` is a torch device (default: CUDA when
    available, else CPU); ``dtype`` the activation dtype (default: the checkpoint's);
    ``kv_cache`` a record kind (``"fp8"``) or a ``KVCacheConfig``; ``policy`` the selection
    policy (default: from the environment). ``plan`` shows every selection made.
    ``cuda_graphs``: on a CUDA device at tensor-parallel size 1, replay decode steps from CUDA
    graphs (``engine.graphs``; also off with ``KERNELBAY_CUDA_GRAPHS=0``).
    """

    def __init__(self, model: str, *, device: str | torch.device | None = None,
                 dtype: str | torch.dtype | None = None, tensor_parallel_size: int = 1,
                 kv_cache: str | KVCacheConfig | None = None,
                 speculative: SpeculativeConfig | str | None = None,
                 policy: Policy | None = None, registry: Registry | None = None,
                 max_model_len: int | None = None, max_num_seqs: int = 16,
                 progress: bool | None = None, cuda_graphs: bool = True) -> None:
        self.folder = CheckpointFolder(model)
        config = self.folder.config
        self.registry = registry if registry is not None else get_registry(policy)
        self.policy = self.registry.policy if policy is None else policy
        torch_device = torch.device(device if device is not None else
                                    ("cuda" if torch.cuda.is_available() else "cpu"))
        self.device = torch_device
        self.capability = self._capability(torch_device)
        self.dtype = _resolve_dtype(dtype, config.dtype_name)
        cache = kv_cache if isinstance(kv_cache, KVCacheConfig) else KVCacheConfig(
            kv_cache or "auto")
        self.tp = init_tensor_parallel(tensor_parallel_size, torch_device.type)
        format_request = self.folder.format_request()
        fmt = select(BackendKind.CHECKPOINT_FORMAT, format_request, self.capability,
                     self.policy, registry=self.registry)
        self.handler = fmt.backend(format_request)
        decisions = [Decision("checkpoint", format_request, fmt)]
        if self.tp.size > 1:
            request = CollectiveRequest("all_reduce", self.tp.size,
                                        str(self.dtype).removeprefix("torch."),
                                        "nccl" if torch_device.type == "cuda" else "gloo")
            chosen = select(BackendKind.COLLECTIVE, request, self.capability, self.policy,
                            registry=self.registry)
            decisions.append(Decision("all_reduce", request, chosen))
            self.tp.collective = chosen.backend(request)
            gemm_request = replace(request, op="gemm_all_reduce")
            gemm = select(BackendKind.COLLECTIVE, gemm_request, self.capability, self.policy,
                          registry=self.registry)
            decisions.append(Decision("gemm_all_reduce", gemm_request, gemm))
            if getattr(gemm.backend, "fuses_gemm", False):
                self.tp.gemm_collective = gemm.backend(gemm_request)
            gather_request = replace(request, op="all_gather")
            gather = select(BackendKind.COLLECTIVE, gather_request, self.capability,
                            self.policy, registry=self.registry)
            decisions.append(Decision("all_gather", gather_request, gather))
            self.tp.gather_collective = gather.backend(gather_request)
        builder = ModelBuilder(self.folder, self.handler, self.registry, self.capability,
                               self.policy, torch_device, self.dtype, self.tp, cache.record,
                               cache.page_size)
        cls = model_class(config.architectures, self.folder.file("config.json"))
        with torch.device(torch_device):
            self.model = cls(builder)
        load_weights(self.model, self.folder, self.handler, self.tp,
                     ignore=lambda name: bool(cls.ignored_tensor(name, config)),
                     progress=progress)
        self.model.eval()
        if self.policy.batch_invariant:  # fixed-order norms, row-by-row tied head
            for module in self.model.modules():
                if isinstance(module, (RMSNorm, VocabParallelEmbedding)):
                    module.batch_invariant = True
        self._decisions = decisions + builder.decisions
        self.max_model_len = max_model_len or min(config.max_position_embeddings or 4096, 8192)
        self.max_num_seqs = max_num_seqs
        num_pages = self._num_pages(builder, cache)
        self.cache = PagedKVCache(builder.attention_layers, num_pages, torch_device)
        graphs = (DecodeGraphs(self.model, self.cache.caches, self.cache.page_size, torch_device,
                               scratch_page=self.cache.scratch_page)
                  if cuda_graphs and self.tp.size == 1 and graphs_enabled(torch_device)
                  else None)
        self.runner = ModelRunner(self.model, self.cache, torch_device, graphs)
        self.eos_token_ids = _eos_ids(self.folder)
        self.tokenizer = self._tokenizer()
        self.speculative = (SpeculativeConfig(speculative) if isinstance(speculative, str)
                            else speculative)
        self.proposer: Proposer | None = None
        if self.speculative is not None:
            self._select_proposer(self.speculative)

    # -- set-up helpers -------------------------------------------------------------------

    def _select_proposer(self, spec: SpeculativeConfig) -> None:
        config = self.folder.config
        request = ProposerRequest(spec.method, spec.num_speculative_tokens,
                                  config.vocab_size or 0, config.model_type,
                                  config.hidden_size or 0, spec.drafter)
        chosen = select(BackendKind.PROPOSER, request, self.capability, self.policy,
                        registry=self.registry)
        self._decisions.append(Decision("proposer", request, chosen))
        self.proposer = chosen.backend(request)
        self.speculator = SpeculativeDecoder(self.runner, self.proposer,
                                             spec.num_speculative_tokens, self.max_num_seqs,
                                             config.vocab_size or 0,
                                             config.num_hidden_layers or 0,
                                             config.hidden_size or 0, self.dtype)

    def _capability(self, device: torch.device) -> DeviceCapability:
        capability = self.registry.device()
        wanted = "cpu" if device.type == "cpu" else ("rocm" if torch.version.hip else "cuda")
        if capability.platform != wanted and capability.source == "probed":
            # the registry probed the default accelerator, but this model runs elsewhere
            # (a CPU model on a GPU host): decide for the device it really runs on
            from kernelbay.device import probe_cpu, probe_device

            return probe_cpu() if wanted == "cpu" else probe_device(device.index or 0)
        if capability.platform != wanted and capability.platform in ("cpu", "cuda", "rocm"):
            raise ConfigError(f"the policy describes device {capability.describe()!r} but the "
                              f"model runs on {device}; device descriptions (KERNELBAY_DEVICE, "
                              "--device) are for planning with explain")
        return capability

    def _num_pages(self, builder: ModelBuilder, cache: KVCacheConfig) -> int:
        per_page = PagedKVCache.bytes_per_page(builder.attention_layers)
        need = pages_for(self.max_model_len, cache.page_size) * self.max_num_seqs
        if cache.memory is None:
            return need
        # a memory budget holds the scratch page too (PagedKVCache.scratch_page)
        if cache.memory > 1:
            return int(cache.memory // per_page) - 1
        total = (torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda"
                 else self.capability.memory_bytes or 0)
        return int(total * cache.memory // per_page) - 1

    def _tokenizer(self) -> Any:
        path = self.folder.file("tokenizer.json")
        if not os.path.exists(path):
            return None
        from tokenizers import Tokenizer

        return Tokenizer.from_file(path)

    # -- public API -----------------------------------------------------------------------

    @property
    def plan(self) -> Plan:
        """Every selection made for this model (as ``kernelbay explain`` shows)."""
        attention = next(d for d in self._decisions if d.module == "attention")
        collective = next((d for d in self._decisions if d.module == "all_reduce"), None)
        gemm = next((d for d in self._decisions if d.module == "gemm_all_reduce"), None)
        gather = next((d for d in self._decisions if d.module == "all_gather"), None)
        proposer = next((d for d in self._decisions if d.module == "proposer"), None)
        linears = tuple(d for d in self._decisions
                        if d.module not in ("checkpoint", "attention", "all_reduce",
                                            "gemm_all_reduce", "all_gather", "proposer"))
        arch = ",".join(self.folder.config.architectures)
        return Plan(self.folder.path, arch, self.capability, self.tp.size, self._decisions[0],
                    linears, attention, collective, proposer, gemm, gather)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (needs the checkpoint's tokenizer.json)."""
        if self.tokenizer is None:
            raise ConfigError(f"{self.folder.path} has no tokenizer.json; pass token ids")
        return list(self.tokenizer.encode(text).ids)

    def decode(self, ids: Seq[int]) -> str:
        """Text of token ids ("" without a tokenizer)."""
        return "" if self.tokenizer is None else str(self.tokenizer.decode(list(ids)))

    def logits(self, token_ids: Seq[int]) -> torch.Tensor:
        """Logits [T, vocab] (float32) of every position of ``token_ids``."""
        seq = Sequence(-1, list(token_ids), len(token_ids), SamplingParams())
        seq.pages = self.cache.allocator.allocate(pages_for(len(token_ids), self.cache.page_size))
        try:
            return self.runner.forward([(seq, len(token_ids))], all_logits=True).float()
        finally:
            self.cache.allocator.free(seq.pages)

    def generate(self, prompts: str | Seq[int] | Seq[str] | Seq[Seq[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None, *,
                 on_token: Callable[[int, int], None] | None = None) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); outputs in prompt order.

        ``params`` is one ``SamplingParams`` for all or one per prompt. ``on_token(index,
        token_id)`` is called for every generated token (for streaming).
        """
        batch = self._prompts(prompts)
        plist: list[SamplingParams] = (
            list(params) if isinstance(params, (list, tuple))
            else [params if isinstance(params, SamplingParams) else SamplingParams()]
            * len(batch))
        if len(plist) != len(batch):
            raise ValueError(f"{len(batch)} prompts but {len(plist)} SamplingParams")
        sequences = [Sequence(i, list(p), len(p), sp)
                     for i, (p, sp) in enumerate(zip(batch, plist, strict=True))]
        for seq in sequences:
            if not seq.tokens:
                raise ValueError(f"prompt {seq.index} is empty")
            if seq.num_prompt + seq.params.max_tokens > self.max_model_len:
                raise ValueError(f"prompt {seq.index}: {seq.num_prompt} tokens + max_tokens "
                                 f"{seq.params.max_tokens} exceed max_model_len "
                                 f"{self.max_model_len}")
        self._run(deque(sequences), on_token)
        return [RequestOutput(s.tokens[:s.num_prompt], s.generated, self.decode(s.generated),
                              s.finish_reason or "length", s.step_times, s.steps)
                for s in sequences]

    # -- the loop -------------------------------------------------------------------------

    def _prompts(self, prompts: Any) -> list[list[int]]:
        if isinstance(prompts, str):
            return [self.encode(prompts)]
        items = list(prompts)
        if items and isinstance(items[0], int):
            return [[int(t) for t in items]]
        return [self.encode(p) if isinstance(p, str) else [int(t) for t in p] for p in items]

    def _run(self, waiting: deque[Sequence], on_token: Callable[[int, int], None] | None
             ) -> None:
        allocator = self.cache.allocator
        page = self.cache.page_size
        # Drafts past max_tokens are never kept, but their K/V are written before verifying.
        lookahead = self.speculative.num_speculative_tokens if self.speculative else 0
        running: list[Sequence] = []
        while waiting or running:
            while waiting and len(running) < self.max_num_seqs:
                seq = waiting[0]
                need = pages_for(seq.num_prompt + seq.params.max_tokens + lookahead, page)
                if need > allocator.free_pages:
                    if not running:
                        raise MemoryError(f"request {seq.index} needs {need} KV-cache pages, "
                                          f"the cache has {allocator.num_pages}")
                    break
                seq.pages = allocator.allocate(need)
                running.append(waiting.popleft())
            start = time.perf_counter()
            if self.proposer is not None:
                produced = self.speculator.step(running)
            else:
                batch = [(s, len(s.tokens) - s.num_cached) for s in running]
                logits = self.runner.forward(batch)
                chosen = sample_tokens(logits, [s.params for s in running],
                                       [len(s.tokens) for s in running]).tolist()
                for seq, token in zip(running, chosen, strict=True):
                    seq.tokens.append(int(token))
                produced = [[int(token)] for token in chosen]
            elapsed = time.perf_counter() - start
            still: list[Sequence] = []
            for seq, new in zip(running, produced, strict=True):
                seq.steps += 1
                self._commit(seq, new, elapsed, on_token)
                if seq.finish_reason is None:
                    still.append(seq)
                else:
                    allocator.free(seq.pages)
            running = still

    def _commit(self, seq: Sequence, new: list[int], elapsed: float,
                on_token: Callable[[int, int], None] | None) -> None:
        """Account for the tokens just appended to ``seq``: stop at a stop token or at
        ``max_tokens`` (dropping what follows), stream them, time them."""
        stops = () if seq.params.ignore_eos else (self.eos_token_ids
                                                  + seq.params.stop_token_ids)
        first = len(seq.tokens) - len(new)
        for i, token in enumerate(new):
            if token in stops:
                seq.finish_reason = "stop"
            elif first + i + 1 - seq.num_prompt >= seq.params.max_tokens:
                seq.finish_reason = "length"
            if seq.finish_reason is not None:
                del seq.tokens[first + i + 1:]
                new = new[:i + 1]
                break
        for token in new:
            seq.step_times.append(elapsed / len(new))
            if on_token is not None:
                on_token(seq.index, token)
