"""``cpu-fp8-moe``: FP8 routed experts through this plugin's compiled W8A16 kernels.

The checkpoint side is the core's ``torch-fp8-moe`` (same canonical per-expert tensors:
``experts.{e}.{p}.weight`` float8_e4m3fn [N, K], ``experts.{e}.{p}.weight_scale`` float32 per
tensor or per block, optional ``input_scale``); this class only changes what happens after
loading and in ``apply_moe``. Per expert, gate and up are stacked into one [2I, H] E4M3 matrix
(one kernel call gives both) and down stays [H, I]; both are packed once (``kernels.
pack_weight``) and keep 8-bit weights in memory. For token t routed to expert e with weight w::

    [g | u] = x[t] @ [W_gate; W_up]^T          one kernel call, fp32 accumulation
    h       = SiLU(g) * u                       in x's dtype (as torch-moe)
    y[t]   += w * (h @ W_down^T)                 second kernel call; fp32 sum over experts

Stacking gate and up keeps each row's own scales: a per-block grid is stacked as is when the
intermediate size I is whole blocks of rows, otherwise each row takes its block's scale
(per-row groups ``(1, bk)``); per-tensor scales become per-row groups over K chunks. The
kernels' bf16 activations make this W8A16 (float32 activations are rounded to bf16 on entry).

This module is imported at discovery: it imports neither torch nor the kernels at module level.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, cast

from kernelbay.layers.moe import (
    EXPERT_PROJECTIONS,
    TorchFp8MoE,
    combine_experts,
    expert_tensor,
    swiglu,
)
from kernelbay.requests import LinearRequest
from kernelbay.verdict import Verdict

from kernelbay_cpu_amx.linear import CpuFp8Avx512Linear, device_checks

if TYPE_CHECKING:
    import torch
    from kernelbay.device import DeviceCapability

    from kernelbay_cpu_amx.kernels import PackedLinear

__all__ = ["CpuFp8MoE"]

_FP8_SCHEMES = ("fp8", "fp8-block")


class CpuFp8MoE(TorchFp8MoE):
    """FP8 E4M3 routed experts (per-tensor or per-block scales) on x86 AVX512-BF16 CPUs: the
    loop over experts of ``torch-fp8-moe`` with each projection computed by the compiled
    W8A16 kernels of ``cpu-fp8-avx512`` on weights packed once (gate and up in one call)."""

    name: ClassVar[str] = "cpu-fp8-moe"
    api_version: ClassVar[str] = "1.0"
    priority: ClassVar[int] = 50
    # The kernels pick their path (decode / tiled) by the number of rows, which changes the
    # order of fp32 sums: a token's result may depend on how many others share its expert.
    batch_invariant: ClassVar[bool] = False
    summary: ClassVar[str] = ("FP8 E4M3 routed experts, W8A16 compiled kernels per expert "
                              "(gate+up fused) on x86 AVX512-BF16 CPUs")

    @classmethod
    def can_implement(cls, request: LinearRequest, device: DeviceCapability) -> Verdict:
        r = request
        s = r.scheme
        handles = Verdict.all(
            Verdict.handles(r.num_experts is not None,
                            f"handles routed-expert MLPs (num_experts set) only, request is "
                            f"a dense {r.role!r} layer"),
            Verdict.handles(s.name in _FP8_SCHEMES,
                            f"handles FP8 experts (schemes {_FP8_SCHEMES}) only, layer is "
                            f"{s.describe()}"),
            # "bfloat16" is QuantScheme's default: a scheme that names no element type.
            Verdict.handles(s.weight_dtype in ("float8_e4m3fn", "bfloat16"),
                            f"handles float8_e4m3fn weights, scheme has {s.weight_dtype!r}"),
        )
        if not handles:
            return handles
        block = cls.block_shape(r)
        split = r.parallel == "column" and r.tp_size > 1 and block is not None
        layout = s.option("weight_layout", "nk")
        verdict = Verdict.all(
            *device_checks(device),
            Verdict.check(r.num_experts is None or r.num_experts >= 1,
                          f"needs num_experts >= 1, request has {r.num_experts}"),
            Verdict.check(not r.bias, f"has no expert biases, request {r.role!r} has bias=True"),
            Verdict.check(layout == "nk",
                          f"reads experts stored [N, K] only, scheme option weight_layout is "
                          f"{layout!r}"),
            Verdict.check(not split or block is None
                          or (r.out_features % block[0] == 0 and r.out_features % block[1] == 0),
                          f"under tensor parallel needs this rank's expert intermediate size "
                          f"(gate/up rows, down columns) in whole scale blocks {block}, "
                          f"request has {r.out_features}"),
        )
        if not verdict:
            return verdict
        # Each projection must suit the dense kernels: the same rules as cpu-fp8-avx512.
        hidden, inter = r.in_features, r.out_features
        notes: list[str] = []
        for label, k, n in (("gate_proj/up_proj", hidden, inter), ("down_proj", inter, hidden)):
            dense = CpuFp8Avx512Linear.can_implement(
                LinearRequest(k, n, s, r.activation_dtype), device)
            if not dense:
                return Verdict.reject(f"{label} [N={n}, K={k}]: {dense.reason}")
            notes += [note for note in dense.notes if note not in notes]
        return Verdict.accept(*notes)

    def kernel_groups(self) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
        """The scale groups the kernels see: (stacked gate/up, down); ``None`` is one scale
        per tensor."""
        from kernelbay_cpu_amx.kernels import per_tensor_chunk

        block = self.block_shape(self.request)
        if block is None:
            return (1, per_tensor_chunk(self.hidden_size)), None
        if block[0] == 1 or self.intermediate_size % block[0] == 0:
            return block, block
        return (1, block[1]), block

    def _gate_up_scales(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The scale grid of the stacked [2I, H] gate/up matrix, for ``kernel_groups()[0]``."""
        import torch

        block = self.block_shape(self.request)
        inter, hidden = self.intermediate_size, self.hidden_size
        group13 = self.kernel_groups()[0]
        assert group13 is not None
        if block is None:  # one scale per tensor -> per row, constant over K chunks
            chunks = hidden // group13[1]
            return torch.cat([gate.reshape(1, 1).expand(inter, chunks),
                              up.reshape(1, 1).expand(inter, chunks)])
        if group13 == block:
            return torch.cat([gate, up])
        # I is not whole row blocks: each row takes its own block's scale.
        rows = torch.arange(inter) // block[0]
        return torch.cat([gate[rows], up[rows]])

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Pack every expert once: ``w13`` [E, 2I/32, H/2, 64] (gate rows, then up rows) with
        ``w13_scale``, ``w2`` [E, H/32, I/2, 64] with ``w2_scale`` (kernel operand form)."""
        import torch

        from kernelbay_cpu_amx import kernels

        params = layer._parameters
        group13, group2 = self.kernel_groups()

        def take(e: int, proj: str, tensor: str) -> torch.Tensor:
            value = cast("torch.Tensor", params.pop(expert_tensor(e, proj, tensor))).detach()
            if tensor == "weight" and value.dtype == torch.uint8:
                value = value.view(torch.float8_e4m3fn)
            return value

        w13, s13, w2, s2 = [], [], [], []
        for e in range(self.num_experts):
            for proj in EXPERT_PROJECTIONS:
                params.pop(expert_tensor(e, proj, "input_scale"), None)  # W8A16: unused
            gate_scale = take(e, "gate_proj", "weight_scale").float()
            up_scale = take(e, "up_proj", "weight_scale").float()
            stacked = torch.cat([take(e, "gate_proj", "weight"), take(e, "up_proj", "weight")])
            w13.append(kernels.pack_weight(stacked))
            s13.append(kernels.scale_operand(self._gate_up_scales(gate_scale, up_scale),
                                             group13))
            w2.append(kernels.pack_weight(take(e, "down_proj", "weight")))
            s2.append(kernels.scale_operand(take(e, "down_proj", "weight_scale").float(),
                                            group2))
        for name, parts in (("w13", w13), ("w13_scale", s13), ("w2", w2), ("w2_scale", s2)):
            setattr(layer, name, torch.nn.Parameter(torch.stack(parts), requires_grad=False))
        kernels.extension()  # build (or load) the kernels now, not in the first forward

    def packed(self, layer: torch.nn.Module, expert: int) -> tuple[PackedLinear, PackedLinear]:
        """One expert's kernel operands: (stacked gate/up, down)."""
        from kernelbay_cpu_amx.kernels import PackedLinear

        group13, group2 = self.kernel_groups()
        hidden, inter = self.hidden_size, self.intermediate_size
        w13 = cast("torch.Tensor", layer.w13)
        s13 = cast("torch.Tensor", layer.w13_scale)
        w2 = cast("torch.Tensor", layer.w2)
        s2 = cast("torch.Tensor", layer.w2_scale)
        return (PackedLinear(w13[expert], s13[expert], group13, None, 2 * inter, hidden),
                PackedLinear(w2[expert], s2[expert], group2, None, hidden, inter))

    def apply_moe(self, layer: torch.nn.Module, x: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor) -> torch.Tensor:
        from kernelbay_cpu_amx import kernels

        if getattr(layer, "w13", None) is None:
            raise RuntimeError(f"{self.name}: call process_weights_after_loading(layer) before "
                               "apply_moe; the packed experts are made there")

        def expert_mlp(expert: int, tokens: torch.Tensor) -> torch.Tensor:
            gate_up_op, down_op = self.packed(layer, expert)
            gate_up = kernels.linear(gate_up_op, x[tokens])
            return kernels.linear(down_op, swiglu(gate_up))

        return combine_experts(x, topk_ids, topk_weights, self.hidden_size, expert_mlp,
                               num_experts=self.num_experts)
