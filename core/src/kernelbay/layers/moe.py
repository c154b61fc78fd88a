"""The fused-MoE seam: a linear method that owns a whole routed-expert MLP, and its reference.

A routed-expert MLP is selected like any linear layer, with a ``LinearRequest`` whose
``role`` is ``"moe_experts"`` (``MOE_EXPERTS_ROLE``) and ``num_experts`` set:

* ``in_features`` (K) is the hidden size, ``out_features`` (N) the expert intermediate size
  of this rank (``moe_intermediate_size / tp_size``);
* ``parallel == "column"`` (tensor parallel) means gate/up are split along N and down along
  its K (the same intermediate), so each rank returns a partial sum the model all-reduces
  once; ``"replicated"`` means every rank holds whole experts;
* ``bias`` is whether the experts carry biases (DeepSeek-V3's do not).

Plain linear methods reject these requests (``Verdict.handles(request.num_experts is None)``);
a MoE method rejects dense ones.

The layer module is the MoE block itself (``model.layers.3.mlp``) and the canonical tensor
names are per expert, relative to it: ``experts.{e}.gate_proj.weight``,
``experts.{e}.up_proj.weight``, ``experts.{e}.down_proj.weight`` (a quantized method adds its
own per-expert tensors, e.g. ``experts.{e}.gate_proj.weight_scale``). So the format's
``source_name("model.layers.3.mlp", "experts.5.gate_proj.weight")`` is the checkpoint name
and the ordinary 1:1 loader reads, validates and shards them. Because these names contain
dots, ``create_weights`` puts the parameters into the layer's parameter dict directly
(``getattr(layer, "experts.5.gate_proj.weight")`` works; ``register_parameter`` would refuse
the name). ``process_weights_after_loading`` then stacks them (``stack_experts``).

Math of ``apply_moe`` for token t with its k-th routed expert ``e = topk_ids[t, k]``::

    h      = SiLU(x[t] @ W_gate[e]^T) * (x[t] @ W_up[e]^T)     activation on gate, times up
    y[t]  += topk_weights[t, k] * (h @ W_down[e]^T)            down, then the routing weight
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, ClassVar, cast

from kernelbay._version import PLUGIN_API_VERSION
from kernelbay.layers.linear import LinearMethod, TensorSpec
from kernelbay.requests import LinearRequest
from kernelbay.verdict import Verdict

if TYPE_CHECKING:
    import torch

    from kernelbay.device import DeviceCapability

__all__ = [
    "EXPERT_PROJECTIONS",
    "MOE_EXPERTS_ROLE",
    "MoEMethod",
    "TorchFp8MoE",
    "TorchMoE",
    "combine_experts",
    "expert_tensor",
    "swiglu",
    "swiglu_experts",
]

#: The ``LinearRequest.role`` of a whole routed-expert MLP (one request for all experts).
MOE_EXPERTS_ROLE = "moe_experts"
#: The projections of one expert, in checkpoint naming.
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_FLOAT_DTYPES = ("float32", "bfloat16", "float16")
_FP8_SCHEMES = ("fp8", "fp8-block")


#: A captured step runs every expert on every token (the routing cannot be read on the host
#: while a CUDA graph is captured). That reads every expert's weights, where the routed
#: experts are at most ``tokens x top-k``: a capture is declined when that is more than this
#: many times fewer experts.
CAPTURED_EXPERTS_PER_ROUTED = 8
#: ... and it multiplies each expert's rows by ``num_experts / top-k``, which costs nothing
#: while an expert's GEMM is bound by reading its weights (few rows) and a lot past that: a
#: capture of more tokens than this is declined.
CAPTURED_MAX_TOKENS = 128


def combine_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    out_features: int,
                    expert_fn: Callable[[int, torch.Tensor], torch.Tensor], *,
                    num_experts: int | None = None) -> torch.Tensor:
    """``sum_k topk_weights[t, k] * expert_fn(topk_ids[t, k], ...)[t]``: the routing every MoE
    method shares. ``expert_fn(expert, tokens)`` computes that expert's output rows for the
    token indices ``tokens``; the weighted sum is accumulated in float32, expert by expert in
    ascending order, and returned [T, out_features] in ``x``'s dtype.

    Eagerly, ``expert_fn`` is called once per expert some token routes to, with those tokens
    (which experts these are is read on the host). While a CUDA graph is being captured that
    read is impossible, so every one of the layer's ``num_experts`` experts is called with
    every token and the rows not routed to it get weight zero: give ``num_experts`` to be
    capturable. Where that reads over ``CAPTURED_EXPERTS_PER_ROUTED`` times more experts
    than are routed, or there are more than ``CAPTURED_MAX_TOKENS`` tokens, it raises
    ``kernelbay.capture.CaptureRefused`` (steps of that size run eagerly)."""
    import torch

    from kernelbay.capture import is_capturing

    if is_capturing(x):
        return _every_expert(x, topk_ids, topk_weights, out_features, expert_fn, num_experts)
    out = torch.zeros(x.shape[0], out_features, dtype=torch.float32, device=x.device)
    ids = topk_ids.long()
    for expert in torch.unique(ids).tolist():
        tokens, slots = torch.where(ids == expert)
        y = expert_fn(int(expert), tokens)
        out.index_add_(0, tokens, y.float() * topk_weights[tokens, slots, None].float())
    return out.to(x.dtype)


def _every_expert(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  out_features: int, expert_fn: Callable[[int, torch.Tensor], torch.Tensor],
                  num_experts: int | None) -> torch.Tensor:
    """``combine_experts`` without reading the routing on the host: each expert on all tokens,
    the rows not routed to it masked out (``where``, so that a row's inf or NaN from an expert
    it does not use cannot reach it)."""
    import torch

    from kernelbay.capture import CaptureRefused

    if num_experts is None:
        raise RuntimeError("combine_experts: capturing a CUDA graph needs num_experts (every "
                           "expert runs on every token); the caller gave none")
    routed = topk_ids.numel()
    if num_experts > CAPTURED_EXPERTS_PER_ROUTED * routed:
        raise CaptureRefused(f"combine_experts: a captured step would read all {num_experts} "
                             f"experts for {x.shape[0]} tokens, more than "
                             f"{CAPTURED_EXPERTS_PER_ROUTED}x the at most {routed} routed "
                             f"ones; steps this small run eagerly")
    if x.shape[0] > CAPTURED_MAX_TOKENS:
        raise CaptureRefused(f"combine_experts: a captured step would run all {num_experts} "
                             f"experts on each of {x.shape[0]} tokens, more than "
                             f"CAPTURED_MAX_TOKENS={CAPTURED_MAX_TOKENS}; steps this large "
                             f"run eagerly")
    out = torch.zeros(x.shape[0], out_features, dtype=torch.float32, device=x.device)
    ids = topk_ids.long()
    tokens = torch.arange(x.shape[0], device=x.device)
    for expert in range(num_experts):
        hit = ids == expert
        weight = torch.where(hit, topk_weights.float(), 0.0).sum(-1, keepdim=True)
        y = expert_fn(expert, tokens)
        out += torch.where(hit.any(-1, keepdim=True), y.float() * weight, 0.0)
    return out.to(x.dtype)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``SiLU(gate) * up`` of a fused ``[T, 2I]`` projection output, gate columns first (the
    ``w13`` stacking of every MoE method)."""
    import torch.nn.functional as F

    inter = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :inter]) * gate_up[..., inter:]


def swiglu_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   w13: torch.Tensor, w2: torch.Tensor,
                   matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
                   ) -> torch.Tensor:
    """Routed SwiGLU experts over stacked dense weights ``w13`` [E, 2I, H] (gate rows, then
    up rows) and ``w2`` [E, H, I]: ``matmul(rows, weight)`` computes ``rows @ weight^T``
    (``F.linear``, or a method's own GEMM), ``combine_experts`` routes and sums."""

    def expert_mlp(expert: int, tokens: torch.Tensor) -> torch.Tensor:
        return matmul(swiglu(matmul(x[tokens], w13[expert])), w2[expert])

    return combine_experts(x, topk_ids, topk_weights, w2.shape[1], expert_mlp,
                           num_experts=w2.shape[0])


def expert_tensor(expert: int, projection: str, tensor: str = "weight") -> str:
    """Canonical name of one expert's tensor, relative to the MoE layer:
    ``experts.{expert}.{projection}.{tensor}``."""
    return f"experts.{expert}.{projection}.{tensor}"


class MoEMethod(LinearMethod):
    """One way to compute a routed-expert MLP: a linear method for ``num_experts`` stacked
    SwiGLU experts (see the module docstring for the request, names and math).

    Subclasses give ``tensor_specs`` (per-expert canonical names), finish them in
    ``process_weights_after_loading`` and compute ``apply_moe``. ``apply`` (a dense
    ``x W^T``) does not exist for a MoE layer.
    """

    @classmethod
    def routed_expert_checks(cls, request: LinearRequest) -> Verdict:
        """What every routed-expert method checks first: a MoE request (not applicable
        otherwise), at least one expert, a float activation dtype, no expert biases."""
        r = request
        return Verdict.all(
            Verdict.handles(r.num_experts is not None,
                            f"handles routed-expert MLPs (num_experts set) only, request is "
                            f"a dense {r.role!r} layer"),
            Verdict.check(r.num_experts is None or r.num_experts >= 1,
                          f"needs num_experts >= 1, request has {r.num_experts}"),
            Verdict.check(r.activation_dtype in _FLOAT_DTYPES,
                          f"needs activation dtype in {_FLOAT_DTYPES}, request has "
                          f"{r.activation_dtype!r}"),
            Verdict.check(not r.bias, f"has no expert biases, request {r.role!r} has bias=True"),
        )

    @property
    def num_experts(self) -> int:
        """Routed experts in this layer."""
        return self.request.num_experts or 0

    @property
    def hidden_size(self) -> int:
        """The model's hidden size (the request's ``in_features``)."""
        return self.request.in_features

    @property
    def intermediate_size(self) -> int:
        """This rank's expert intermediate size (the request's ``out_features``)."""
        return self.request.out_features

    def projection_shard_dims(self) -> dict[str, int | None]:
        """Dimension of each [N, K] projection split across ranks: gate/up along their N
        (0), down along its K (1); ``None`` when the experts are replicated."""
        if self.request.parallel != "column":
            return dict.fromkeys(EXPERT_PROJECTIONS)
        return {"gate_proj": 0, "up_proj": 0, "down_proj": 1}

    def projections(self) -> Iterator[tuple[int, str, int, int, int | None]]:
        """Every expert projection of this rank: (expert, projection, N, K, shard dim), with
        gate/up [intermediate, hidden] and down [hidden, intermediate]."""
        hidden, inter = self.hidden_size, self.intermediate_size
        shard = self.projection_shard_dims()
        shapes = {"gate_proj": (inter, hidden), "up_proj": (inter, hidden),
                  "down_proj": (hidden, inter)}
        for e in range(self.num_experts):
            for p in EXPERT_PROJECTIONS:
                yield e, p, *shapes[p], shard[p]

    def expert_weight_specs(self, dtype: str) -> dict[str, TensorSpec]:
        """``experts.{e}.{gate,up,down}_proj.weight`` of every expert, in ``dtype``."""
        return {expert_tensor(e, p): TensorSpec((n, k), dtype, shard)
                for e, p, n, k, shard in self.projections()}

    def create_weights(self, layer: torch.nn.Module, device: torch.device | str = "cpu") -> None:
        """One empty parameter per tensor spec, stored under its dotted canonical name."""
        import torch

        for name, spec in self.tensor_specs().items():
            tensor = torch.empty(spec.shape, dtype=getattr(torch, spec.dtype), device=device)
            # register_parameter refuses dotted names; the parameter dict does not, and the
            # loader finds them with getattr(layer, name).
            layer._parameters[name] = torch.nn.Parameter(tensor, requires_grad=False)

    def stack_experts(self, layer: torch.nn.Module, tensor: str = "weight"
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Remove the per-expert ``tensor`` parameters from ``layer`` and return them stacked:
        ``w13`` [E, 2N, ...] (gate rows, then up rows, per expert) and ``w2`` [E, ...] (down).
        """
        import torch

        params = layer._parameters
        w13, w2 = [], []
        for e in range(self.num_experts):
            gate = cast("torch.Tensor", params.pop(expert_tensor(e, "gate_proj", tensor)))
            up = cast("torch.Tensor", params.pop(expert_tensor(e, "up_proj", tensor)))
            down = cast("torch.Tensor", params.pop(expert_tensor(e, "down_proj", tensor)))
            w13.append(torch.cat([gate, up], dim=0))
            w2.append(down)
        return torch.stack(w13), torch.stack(w2)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        raise TypeError(f"{type(self).__qualname__} computes a routed-expert MLP; call "
                        "apply_moe(layer, x, topk_ids, topk_weights)")

    def dequantized_weight(self, layer: torch.nn.Module) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__qualname__} does not implement "
                                  "dequantized_weight: a MoE layer has no single dense weight")

    def apply_moe(self, layer: torch.nn.Module, x: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor) -> torch.Tensor:
        """``sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t])`` for ``x`` [T, hidden],
        ``topk_ids`` [T, k] (int), ``topk_weights`` [T, k] (float32): [T, hidden] in x's dtype.
        Under tensor parallel this is the rank's partial sum (the caller all-reduces)."""
        raise NotImplementedError(f"{type(self).__qualname__} does not implement apply_moe")


class TorchMoE(MoEMethod):
    """Unquantized routed experts in plain torch: per-expert gather, SwiGLU, scatter-add."""

    name: ClassVar[str] = "torch-moe"
    api_version: ClassVar[str] = PLUGIN_API_VERSION
    priority: ClassVar[int] = 0
    # a variable number of routed rows goes through one matmul, whose kernel may change with it
    batch_invariant: ClassVar[bool] = False
    summary: ClassVar[str] = "unquantized routed experts (SwiGLU), loop over experts, any device"

    @classmethod
    def can_implement(cls, request: LinearRequest, device: DeviceCapability) -> Verdict:
        del device  # plain torch: any device
        r = request
        return Verdict.all(
            cls.routed_expert_checks(r),
            Verdict.handles(not r.scheme.is_quantized,
                            f"handles unquantized experts only, layer is {r.scheme.describe()}"),
        )

    def tensor_specs(self) -> Mapping[str, TensorSpec]:
        return self.expert_weight_specs(self.request.activation_dtype)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        import torch

        w13, w2 = self.stack_experts(layer)
        layer.w13 = torch.nn.Parameter(w13, requires_grad=False)  # [E, 2I, H]
        layer.w2 = torch.nn.Parameter(w2, requires_grad=False)    # [E, H, I]

    def apply_moe(self, layer: torch.nn.Module, x: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F

        return swiglu_experts(x, topk_ids, topk_weights, cast("torch.Tensor", layer.w13),
                              cast("torch.Tensor", layer.w2), F.linear)


class TorchFp8MoE(TorchMoE):
    """FP8 E4M3 routed experts (schemes ``fp8`` and ``fp8-block``), the reference: every
    expert projection is dequantized once after loading through ``kernelbay.formats.fp8``
    (``float(q) * scale``, per tensor or per ``group_shape`` tile), then ``torch-moe``'s
    stacking and math run on the dense experts. Weight-only: activations stay in their dtype.

    Per expert ``e`` and projection ``p`` the canonical tensors are those of the FP8
    reference linear: ``experts.{e}.{p}.weight`` float8_e4m3fn [N, K],
    ``experts.{e}.{p}.weight_scale`` float32 (``[]`` per tensor, ``[ceil(N/bn), ceil(K/bk)]``
    per block; the dequant multiplier), and an optional ``experts.{e}.{p}.input_scale``
    float32 ``[]`` that static-activation exports carry and weight-only math ignores.
    """

    name: ClassVar[str] = "torch-fp8-moe"
    api_version: ClassVar[str] = PLUGIN_API_VERSION
    priority: ClassVar[int] = 0
    batch_invariant: ClassVar[bool] = False
    summary: ClassVar[str] = ("FP8 per-tensor / per-block routed experts, dequantize once, "
                              "then torch-moe's math, any device")

    @classmethod
    def can_implement(cls, request: LinearRequest, device: DeviceCapability) -> Verdict:
        del device  # plain torch: any device
        r = request
        block = cls.block_shape(r)
        # Under tensor parallel a rank holds gate/up rows [rank * I, (rank + 1) * I) and the
        # same columns of down; its slice of a block grid is exact only for whole blocks.
        split = r.parallel == "column" and r.tp_size > 1 and block is not None
        return Verdict.all(
            cls.routed_expert_checks(r),
            Verdict.handles(r.scheme.name in _FP8_SCHEMES,
                            f"handles FP8 experts (schemes {_FP8_SCHEMES}) only, layer is "
                            f"{r.scheme.describe()}"),
            Verdict.check(block is None or min(block) > 0,
                          f"needs a positive scale block, scheme has {block}"),
            Verdict.check(not split or block is None
                          or (r.out_features % block[0] == 0 and r.out_features % block[1] == 0),
                          f"under tensor parallel needs this rank's expert intermediate size "
                          f"(gate/up rows, down columns) in whole scale blocks {block}, "
                          f"request has {r.out_features}"),
        )

    @staticmethod
    def block_shape(request: LinearRequest) -> tuple[int, int] | None:
        """The (rows, cols) scale tile of an ``fp8-block`` request (``None``: per tensor)."""
        if request.scheme.name != "fp8-block":
            return None
        return request.scheme.group_shape or (128, 128)

    def tensor_specs(self) -> Mapping[str, TensorSpec]:
        block = self.block_shape(self.request)
        specs: dict[str, TensorSpec] = {}
        for name, spec in self.expert_weight_specs("float8_e4m3fn").items():
            n, k = spec.shape
            specs[name] = spec
            prefix = name.removesuffix(".weight")
            if block is None:
                specs[f"{prefix}.weight_scale"] = TensorSpec((), "float32")
            else:
                # The grid splits with its weight (whole blocks: can_implement checks it).
                specs[f"{prefix}.weight_scale"] = TensorSpec(
                    (-(-n // block[0]), -(-k // block[1])), "float32", spec.shard_dim)
            specs[f"{prefix}.input_scale"] = TensorSpec((), "float32", None, required=False)
        return specs

    def dequantize_experts(self, layer: torch.nn.Module, dtype: torch.dtype) -> None:
        """Replace every expert's FP8 ``weight`` by its dequantized value in ``dtype`` and
        drop its scales (``weight_scale``, ``input_scale``) from ``layer``."""
        import torch

        from kernelbay.formats.fp8 import dequantize_fp8_per_block, dequantize_fp8_per_tensor

        params = layer._parameters
        block = self.block_shape(self.request)
        for e in range(self.num_experts):
            for proj in EXPERT_PROJECTIONS:
                weight = cast("torch.Tensor", params[expert_tensor(e, proj)]).detach()
                scale = cast("torch.Tensor",
                             params.pop(expert_tensor(e, proj, "weight_scale"))).detach()
                params.pop(expert_tensor(e, proj, "input_scale"), None)
                dense = (dequantize_fp8_per_tensor(weight, scale, dtype) if block is None
                         else dequantize_fp8_per_block(weight, scale, block, dtype))
                params[expert_tensor(e, proj)] = torch.nn.Parameter(dense, requires_grad=False)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Dequantize every expert once (in the activation dtype), then stack them as
        ``torch-moe`` does: ``w13`` [E, 2I, H], ``w2`` [E, H, I]."""
        import torch

        self.dequantize_experts(layer, getattr(torch, self.request.activation_dtype))
        super().process_weights_after_loading(layer)
