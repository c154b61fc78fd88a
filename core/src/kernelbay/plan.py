"""The per-layer plan for a checkpoint: which format reads it and which backend runs each layer.

``plan_checkpoint`` reads only JSON and safetensors headers (no tensor data, no code from the
checkpoint) and asks selection for every layer, so ``kernelbay explain`` can show the whole
plan, with every candidate's verdict, for hardware that is not here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, final

from kernelbay.checkpoint.folder import CheckpointFolder
from kernelbay.checkpoint.layout import collapse_index
from kernelbay.device import DeviceCapability
from kernelbay.errors import ConfigError, ForcedBackendError, NoBackendError
from kernelbay.kinds import BackendKind
from kernelbay.layers.checkpoint_format import CheckpointFormat, LinearModule
from kernelbay.plugins import Registry, get_registry
from kernelbay.policy import Policy
from kernelbay.requests import (
    AttentionRequest,
    CollectiveRequest,
    LayerRole,
    LinearRequest,
    QuantScheme,
)
from kernelbay.select import Selection, select
from kernelbay.trace import TraceLine

__all__ = ["Decision", "Plan", "attention_request", "plan_checkpoint", "shard_linear"]

# Tensor-parallel style per role: column splits N, row splits K, replicated keeps both.
_PARALLEL = {
    LayerRole.ATTN_QKV: "column", LayerRole.ATTN_OUT: "row", LayerRole.MLP_GATE_UP: "column",
    LayerRole.MLP_DOWN: "row", LayerRole.LM_HEAD: "column", LayerRole.ROUTER: "replicated",
    LayerRole.OTHER: "replicated",
}
# Small latent projections of MLA stay whole on every rank.
_REPLICATED_LEAVES = ("q_a_proj", "kv_a_proj_with_mqa")


def parallel_style(module: str, role: str) -> str:
    """``column``, ``row`` or ``replicated`` for a linear module under tensor parallel."""
    leaf = module.rsplit(".", 1)[-1]
    if leaf in _REPLICATED_LEAVES:
        return "replicated"
    if role == LayerRole.MOE_EXPERT:
        return "row" if leaf in ("down_proj", "w2") else "column"
    return _PARALLEL.get(role, "replicated")


def shard_linear(module: LinearModule, scheme: QuantScheme, activation_dtype: str,
                 tp_rank: int = 0, tp_size: int = 1) -> LinearRequest:
    """The request one rank's shard of ``module`` makes; ``ConfigError`` if it cannot split."""
    style = parallel_style(module.name, module.role) if tp_size > 1 else "replicated"
    k, n = module.in_features, module.out_features
    if style == "column" and module.role == LayerRole.LM_HEAD:
        n = -(-n // tp_size)  # vocabulary shards are padded; the engine slices the padding off
    elif style == "column":
        if n % tp_size:
            raise ConfigError(f"{module.name}: out_features {n} is not divisible by "
                              f"tensor-parallel size {tp_size}")
        n //= tp_size
    elif style == "row":
        if k % tp_size:
            raise ConfigError(f"{module.name}: in_features {k} is not divisible by "
                              f"tensor-parallel size {tp_size}")
        k //= tp_size
    return LinearRequest(k, n, scheme, activation_dtype, module.bias, module.role, style,
                         tp_rank, tp_size)


def attention_request(folder: CheckpointFolder, tp_size: int = 1,
                      kv_cache: str = "auto") -> AttentionRequest:
    """The attention request of one rank, from ``config.json``."""
    c = folder.config
    heads = c.num_attention_heads or 0
    dtype = c.dtype_name
    if heads % tp_size:
        raise ConfigError(f"{folder.file('config.json')}: num_attention_heads {heads} is not "
                          f"divisible by tensor-parallel size {tp_size}")
    if c.kv_lora_rank:
        rope = c.qk_rope_head_dim or 0
        return AttentionRequest("mla", heads // tp_size, 1, (c.qk_nope_head_dim or 0) + rope,
                                c.v_head_dim, c.kv_lora_rank, rope, dtype, kv_cache)
    kv_heads = c.num_kv_heads
    kind = "mha" if kv_heads == heads else ("mqa" if kv_heads == 1 else "gqa")
    window = getattr(c, "sliding_window", None)
    return AttentionRequest(kind, heads // tp_size, max(1, kv_heads // tp_size), c.head_size,
                            None, None, None, dtype, kv_cache,
                            sliding_window=window if isinstance(window, int) else None)


@final
@dataclass(frozen=True)
class Decision:
    """One layer's request and its selection, or why nothing could be selected."""

    module: str
    request: object
    selection: Selection[Any] | None
    error: str = ""
    failed_trace: tuple[TraceLine, ...] = ()

    @property
    def trace(self) -> tuple[TraceLine, ...]:
        """Every candidate's outcome, whether or not one was chosen."""
        return self.selection.trace if self.selection is not None else self.failed_trace

    @property
    def chosen(self) -> str:
        """Chosen backend name, or ``"-"``."""
        return self.selection.name if self.selection is not None else "-"

    def as_dict(self) -> dict[str, object]:
        """JSON-ready form (stable keys)."""
        describe = getattr(self.request, "describe", None)
        return {"module": self.module,
                "request": describe() if callable(describe) else repr(self.request),
                "chosen": self.chosen, "error": self.error,
                "trace": [t.as_dict() for t in self.trace]}


@final
@dataclass(frozen=True)
class Plan:
    """The whole plan for one checkpoint on one device."""

    checkpoint: str
    architecture: str
    device: DeviceCapability
    tp_size: int
    format: Decision
    linears: tuple[Decision, ...]
    attention: Decision
    collective: Decision | None
    proposer: Decision | None = None
    #: The collective chosen for row-parallel GEMM + all-reduce (tensor parallel only).
    gemm_collective: Decision | None = None
    #: The collective chosen for all-gather (the vocabulary-parallel logits; tensor parallel
    #: only): its own decision, since a backend may implement all-reduce alone.
    gather_collective: Decision | None = None

    @property
    def ok(self) -> bool:
        """True when every decision found a backend."""
        every = [self.format, self.attention, *self.linears]
        every += [d for d in (self.collective, self.gemm_collective, self.gather_collective)
                  if d is not None]
        return all(d.selection is not None for d in every)

    def groups(self) -> list[tuple[str, int, Decision]]:
        """Linear decisions grouped by collapsed name and outcome: (pattern, count, example)."""
        grouped: dict[tuple[str, str, str, str], list[Decision]] = {}
        for d in self.linears:
            describe = getattr(d.request, "describe", lambda: "")
            key = (collapse_index(d.module), d.chosen, describe(), d.error)
            grouped.setdefault(key, []).append(d)
        return [(k[0], len(v), v[0]) for k, v in grouped.items()]

    def as_dict(self) -> dict[str, object]:
        """JSON-ready form (stable keys)."""
        return {
            "checkpoint": self.checkpoint,
            "architecture": self.architecture,
            "device": self.device.as_dict(),
            "tp_size": self.tp_size,
            "ok": self.ok,
            "format": self.format.as_dict(),
            "attention": self.attention.as_dict(),
            "collective": self.collective.as_dict() if self.collective else None,
            "gemm_collective": (self.gemm_collective.as_dict() if self.gemm_collective
                                else None),
            "gather_collective": (self.gather_collective.as_dict() if self.gather_collective
                                  else None),
            "linears": [d.as_dict() for d in self.linears],
        }


def _decide(kind: BackendKind, module: str, request: object, device: DeviceCapability,
            policy: Policy, registry: Registry) -> Decision:
    try:
        return Decision(module, request, select(kind, request, device, policy,
                                                registry=registry))
    except (NoBackendError, ForcedBackendError) as exc:
        return Decision(module, request, None, str(exc), exc.trace)


def plan_checkpoint(path: str, *, device: DeviceCapability | None = None,
                    policy: Policy | None = None, registry: Registry | None = None,
                    tp_size: int = 1, kv_cache: str = "auto") -> Plan:
    """Plan every layer of the checkpoint at ``path`` (rank 0 of ``tp_size``)."""
    registry = registry if registry is not None else get_registry(policy)
    policy = registry.policy if policy is None else policy
    device = registry.device() if device is None else device
    if tp_size > 1 and device.device_count < tp_size:
        device = replace(device, device_count=tp_size)
    folder = CheckpointFolder(path)
    request = folder.format_request()
    fmt = _decide(BackendKind.CHECKPOINT_FORMAT, "checkpoint", request, device, policy, registry)
    collective: Decision | None = None
    gemm_collective: Decision | None = None
    gather_collective: Decision | None = None
    if tp_size > 1:
        transport = "nccl" if device.platform in ("cuda", "rocm") else "gloo"
        coll_req = CollectiveRequest("all_reduce", tp_size, folder.config.dtype_name, transport)
        collective = _decide(BackendKind.COLLECTIVE, "all_reduce", coll_req, device, policy,
                             registry)
        gemm_collective = _decide(BackendKind.COLLECTIVE, "gemm_all_reduce",
                                  replace(coll_req, op="gemm_all_reduce"), device, policy,
                                  registry)
        gather_collective = _decide(BackendKind.COLLECTIVE, "all_gather",
                                    replace(coll_req, op="all_gather"), device, policy,
                                    registry)
    arch = ",".join(folder.config.architectures) or folder.config.model_type or "unknown"
    if fmt.selection is not None and _supported(folder):
        built = _plan_by_building(folder, fmt.selection.backend(request), registry, device,
                                  policy, tp_size, kv_cache)
        attention = next((d for d in built if d.module == "attention"),
                         Decision("attention", None, None, "the model has no attention layer"))
        built_linears = tuple(d for d in built if d.module != "attention")
        return Plan(folder.path, arch, device, tp_size, fmt, built_linears, attention,
                    collective, gemm_collective=gemm_collective,
                    gather_collective=gather_collective)
    linears: list[Decision] = []
    if fmt.selection is not None:
        handler: CheckpointFormat = fmt.selection.backend(request)
        dtype = folder.config.dtype_name
        activation = dtype if dtype in ("bfloat16", "float16", "float32") else "bfloat16"
        modules: Sequence[LinearModule] = handler.linear_modules(folder.tensors)
        for module in modules:
            try:
                req = shard_linear(module, handler.scheme_for(module.name), activation, 0,
                                   tp_size)
            except ConfigError as exc:
                linears.append(Decision(module.name, None, None, str(exc)))
                continue
            linears.append(_decide(BackendKind.LINEAR, module.name, req, device, policy,
                                   registry))
    try:
        attn_req: object = attention_request(folder, tp_size, kv_cache)
        attention = _decide(BackendKind.ATTENTION, "attention", attn_req, device, policy,
                            registry)
    except ConfigError as exc:
        attention = Decision("attention", None, None, str(exc))
    return Plan(folder.path, arch, device, tp_size, fmt, tuple(linears), attention, collective,
                gemm_collective=gemm_collective, gather_collective=gather_collective)


def _supported(folder: CheckpointFolder) -> bool:
    from kernelbay.engine.models import SUPPORTED_ARCHITECTURES

    return any(a in SUPPORTED_ARCHITECTURES for a in folder.config.architectures)


def _plan_by_building(folder: CheckpointFolder, handler: CheckpointFormat, registry: Registry,
                      device: DeviceCapability, policy: Policy, tp_size: int,
                      kv_cache: str) -> list[Decision]:
    """The engine's own decisions: build the model on the meta device (no memory, no data)
    in planning mode, exactly as ``LLM`` would on rank 0."""
    import torch

    from kernelbay.engine.build import ModelBuilder
    from kernelbay.engine.models import model_class
    from kernelbay.engine.parallel import TensorParallel

    dtype_name = folder.config.dtype_name
    dtype = getattr(torch, dtype_name if dtype_name in ("float32", "float16") else "bfloat16")
    meta = torch.device("meta")
    builder = ModelBuilder(folder, handler, registry, device, policy, meta, dtype,
                           TensorParallel(0, tp_size), kv_cache, planning=True)
    cls = model_class(folder.config.architectures, folder.file("config.json"))
    with meta:
        cls(builder)
    return builder.decisions
