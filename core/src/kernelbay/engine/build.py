"""Model construction: select a backend for every layer while the model is built."""

from __future__ import annotations

from typing import Any

import torch

from kernelbay.checkpoint.folder import CheckpointFolder
from kernelbay.device import DeviceCapability
from kernelbay.engine.modules import AttentionLayer, Linear, RMSNorm
from kernelbay.engine.parallel import TensorParallel
from kernelbay.errors import CheckpointError, ConfigError, ForcedBackendError, NoBackendError
from kernelbay.kinds import BackendKind
from kernelbay.layers import AttentionBackend, CheckpointFormat, MoEMethod
from kernelbay.layers.moe import TorchMoE
from kernelbay.layers.torch_attention import TorchPagedAttention
from kernelbay.layers.torch_linear import TorchUnquantizedLinear
from kernelbay.layers.torch_mla import TorchMLAAttention
from kernelbay.plan import Decision, shard_linear
from kernelbay.plugins import Registry
from kernelbay.policy import Policy
from kernelbay.requests import AttentionRequest, LinearRequest, QuantScheme
from kernelbay.select import select

__all__ = ["ModelBuilder"]


class ModelBuilder:
    """Everything a model family needs to build itself: the checkpoint, its format handler,
    the policy and device to select for, the torch device and dtype, and tensor parallel.

    Every selection is recorded in ``decisions`` (the plan ``LLM.plan`` shows). With
    ``planning=True`` (``kernelbay explain``, on the meta device) a layer that no backend
    accepts is recorded with its error and built from a core reference as a stand-in, so the
    whole plan is shown; such a model is never run.
    """

    def __init__(self, folder: CheckpointFolder, handler: CheckpointFormat, registry: Registry,
                 capability: DeviceCapability, policy: Policy, device: torch.device,
                 dtype: torch.dtype, tp: TensorParallel, kv_cache: str = "auto",
                 page_size: int = 16, planning: bool = False) -> None:
        self.folder = folder
        self.config = folder.config
        self.handler = handler
        self.registry = registry
        self.capability = capability
        self.policy = policy
        self.device = device
        self.dtype = dtype
        self.tp = tp
        self.kv_cache = kv_cache
        self.page_size = page_size
        self.planning = planning
        self.linear_modules = {m.name: m for m in handler.linear_modules(folder.tensors)}
        self.decisions: list[Decision] = []
        self.attention_layers: list[AttentionLayer] = []
        self._attention_backends: dict[AttentionRequest, AttentionBackend] = {}

    def _select(self, kind: BackendKind, module: str, request: Any,
                stand_in: type[Any]) -> type[Any]:
        """The selected class for ``request``, recording the decision; in planning mode a
        failed selection is recorded and ``stand_in`` (a core reference) is returned."""
        try:
            selection = select(kind, request, self.capability, self.policy,
                               registry=self.registry)
        except (NoBackendError, ForcedBackendError) as exc:
            if not self.planning:
                raise
            self.decisions.append(Decision(module, request, None, str(exc), exc.trace))
            return stand_in
        self.decisions.append(Decision(module, request, selection))
        return selection.backend

    @property
    def dtype_name(self) -> str:
        """The activation dtype name (``"bfloat16"`` ...)."""
        return str(self.dtype).removeprefix("torch.")

    def linear(self, name: str, in_features: int, out_features: int) -> Linear:
        """The layer ``name`` with its selected method; checks the checkpoint's logical shape
        against what the architecture expects (``in_features``, ``out_features`` unsharded)."""
        module = self.linear_modules.get(name)
        if module is None:
            weight = self.handler.source_name(name, "weight")
            raise CheckpointError(self.folder.path, f"missing tensor {weight!r} of linear layer "
                                  f"{name!r} [{out_features}, {in_features}]", tensor=weight)
        if (module.in_features, module.out_features) != (in_features, out_features):
            raise CheckpointError(self.folder.path, f"linear layer {name!r} has logical shape "
                                  f"[{module.out_features}, {module.in_features}], the config "
                                  f"implies [{out_features}, {in_features}]",
                                  tensor=self.handler.source_name(name, "weight"))
        request = shard_linear(module, self.handler.scheme_for(name), self.dtype_name,
                               self.tp.rank, self.tp.size)
        cls = self._select(BackendKind.LINEAR, name, request, TorchUnquantizedLinear)
        return Linear(cls(request), self.tp, self.device)

    def moe_method(self, prefix: str, hidden: int, intermediate: int,
                   num_experts: int) -> MoEMethod:
        """Select the method of the routed-expert MLP at ``prefix`` (``model.layers.3.mlp``,
        experts ``{prefix}.experts.{e}.{gate,up,down}_proj``) and record the decision.

        ``intermediate`` is the unsharded expert intermediate size; under tensor parallel
        each rank's request holds ``intermediate / tp`` (gate/up split on N, down on K).
        """
        from kernelbay.layers.moe import EXPERT_PROJECTIONS, MOE_EXPERTS_ROLE

        shapes = {"gate_proj": (hidden, intermediate), "up_proj": (hidden, intermediate),
                  "down_proj": (intermediate, hidden)}
        schemes: set[QuantScheme] = set()
        bias = False
        for e in range(num_experts):
            for proj in EXPERT_PROJECTIONS:
                name = f"{prefix}.experts.{e}.{proj}"
                k, n = shapes[proj]
                module = self.linear_modules.get(name)
                weight = self.handler.source_name(name, "weight")
                if module is None:
                    raise CheckpointError(self.folder.path, f"missing tensor {weight!r} of "
                                          f"routed expert {e} [{n}, {k}]", tensor=weight)
                if (module.in_features, module.out_features) != (k, n):
                    raise CheckpointError(self.folder.path, f"expert layer {name!r} has "
                                          f"logical shape [{module.out_features}, "
                                          f"{module.in_features}], the config implies "
                                          f"[{n}, {k}]", tensor=weight)
                schemes.add(self.handler.scheme_for(name))
                bias = bias or module.bias
        if len(schemes) != 1:
            raise ConfigError(f"{prefix}: the routed experts mix quant schemes "
                              f"{sorted(s.describe() for s in schemes)}; one MoE layer needs one")
        tp = self.tp.size
        if intermediate % tp:
            raise ConfigError(f"{prefix}: moe intermediate size {intermediate} is not "
                              f"divisible by tensor-parallel size {tp}")
        request = LinearRequest(hidden, intermediate // tp, schemes.pop(), self.dtype_name,
                                bias, MOE_EXPERTS_ROLE, "column" if tp > 1 else "replicated",
                                self.tp.rank, tp, num_experts)
        cls = self._select(BackendKind.LINEAR, f"{prefix}.experts", request, TorchMoE)
        method = cls(request)
        # selection offers routed experts to MoEMethods only (select._not_applicable)
        assert isinstance(method, MoEMethod), cls.name
        return method

    def moe(self, prefix: str, hidden: int, intermediate: int, num_experts: int) -> Linear:
        """The routed-expert MLP at ``prefix`` as a ``Linear`` module running its selected
        ``MoEMethod`` (call ``layer.method.apply_moe``); place it at ``prefix`` in the model
        so its per-expert tensors load by name. See ``moe_method``."""
        return Linear(self.moe_method(prefix, hidden, intermediate, num_experts), self.tp,
                      self.device)

    def has_linear(self, name: str) -> bool:
        """Whether the checkpoint holds the linear layer ``name``."""
        return name in self.linear_modules

    def attention(self, request: AttentionRequest, scale: float) -> AttentionLayer:
        """The next attention layer (layers are numbered in construction order)."""
        backend = self._attention_backends.get(request)
        if backend is None:
            stand_in = TorchMLAAttention if request.attention == "mla" else TorchPagedAttention
            backend = self._select(BackendKind.ATTENTION, "attention", request, stand_in)(
                request)
            self._attention_backends[request] = backend
        layer = AttentionLayer(backend, len(self.attention_layers), scale)
        self.attention_layers.append(layer)
        return layer

    def norm(self, size: int, eps: float | None = None) -> RMSNorm:
        """An RMSNorm with the config's epsilon."""
        value = eps if eps is not None else (self.config.rms_norm_eps or 1e-6)
        return RMSNorm(size, value, self.dtype, self.device)

    def config_value(self, key: str, default: Any = None) -> Any:
        """A config field, known or extra."""
        return getattr(self.config, key, None) if hasattr(self.config, key) else (
            (self.config.model_extra or {}).get(key, default))
