"""Linear methods on x86 CPUs with AVX512-BF16 (AMX tiles where the CPU and OS allow).

``cpu-fp8-avx512``: FP8 E4M3 weights (per-tensor or per-block fp32 scales) x bf16 activations,
W8A16. ``cpu-bf16-avx512``: unquantized bf16 weights through the same kernels. The math and
the packed layout are in ``kernels.py`` and ``csrc/fp8_linear.h``.

This module is imported at discovery: it imports neither torch nor the compiled kernels at
module level (``kernels`` is imported inside the methods that compute).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar, cast

from kernelbay.layers.linear import LinearMethod, TensorSpec
from kernelbay.requests import LinearRequest
from kernelbay.verdict import Verdict

if TYPE_CHECKING:
    import torch
    from kernelbay.device import DeviceCapability

    from kernelbay_cpu_amx.kernels import PackedLinear

__all__ = [
    "REQUIRED_CPU_FLAGS",
    "CpuBf16Avx512Linear",
    "CpuFp8Avx512Linear",
    "device_checks",
    "fp8_group",
    "kernel_group",
    "replicated_block_scales",
    "weight_layout",
]

#: CPU flags (as /proc/cpuinfo spells them) the kernels need.
REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")
#: Flags that enable the AMX tiles of the large-M path (used only when the OS grants them).
AMX_CPU_FLAGS = ("amx_bf16", "amx_tile")
#: Output columns per packed tile: N must be a multiple.
N_MULTIPLE = 32
#: The K block (columns per scale) must be a multiple of this (dot products read K in pairs,
#: AMX tiles in 32s).
K_BLOCK_MULTIPLE = 32
_FP8_SCHEMES = ("fp8", "fp8-block")
_FP8_ACTIVATION_DTYPES = ("bfloat16", "float32")
# W8A16 computes with bf16 activations whatever the checkpoint's activation scheme says.
_ACTIVATION_SCHEMES = (None, "fp8-static", "fp8-dynamic")
_LAYOUTS = ("nk", "kn")


def device_checks(device: DeviceCapability) -> list[Verdict]:
    """The device rules of every method here: an x86 CPU with ``REQUIRED_CPU_FLAGS``."""
    missing = [f for f in REQUIRED_CPU_FLAGS if not device.has(f)]
    return [
        Verdict.check(device.platform == "cpu",
                      f"runs on x86 CPUs, device platform is {device.platform!r}"),
        Verdict.check(device.arch == "x86_64", f"needs arch 'x86_64', device has "
                                               f"{device.arch!r}"),
        Verdict.check(not missing, f"needs CPU flags {list(REQUIRED_CPU_FLAGS)}, device lacks "
                                   f"{missing}"),
    ]


def _path_note(device: DeviceCapability) -> str:
    if all(device.has(f) for f in AMX_CPU_FLAGS):
        return "AMX tiles for M >= 8 when the OS grants tile data, else AVX512-BF16"
    return "AVX512-BF16 dot products (no AMX on this device)"


def fp8_group(request: LinearRequest) -> tuple[int, int] | None:
    """(rows of N, columns of K) per scale for ``fp8-block`` (default 128 x 128), else None."""
    if request.scheme.name != "fp8-block":
        return None
    return request.scheme.group_shape or (128, 128)


def weight_layout(request: LinearRequest) -> str:
    """``"nk"`` (the canonical [N, K]) or ``"kn"``, from the scheme option ``weight_layout``
    a checkpoint format sets for an exporter that writes [K, N]."""
    layout = request.scheme.option("weight_layout", "nk") or "nk"
    if layout not in _LAYOUTS:
        raise ValueError(f"scheme option weight_layout={layout!r}; valid: {_LAYOUTS}")
    return layout


def _grid(rows: int, cols: int, block: tuple[int, int]) -> tuple[int, int]:
    return -(-rows // block[0]), -(-cols // block[1])


def replicated_block_scales(request: LinearRequest) -> bool:
    """True when this rank cannot take a slice of the block-scale grid and reads it whole.

    Column-parallel layers split N; when a rank's N is not a whole number of ``bn``-row
    blocks (e.g. 128 x 128 tiles on a 192-row projection under TP 2), a scale row straddles
    two ranks. Then every rank reads the full grid and picks the scale of each of its own
    rows (global row ``tp_rank * N + i``), making per-row scales. Row-parallel layers need
    their K shard to be whole K blocks, which ``can_implement`` checks.
    """
    group = fp8_group(request)
    return (group is not None and request.parallel == "column" and request.tp_size > 1
            and request.out_features % group[0] != 0)


def kernel_group(request: LinearRequest) -> tuple[int, int] | None:
    """The scale block the kernels see after loading: ``fp8_group``, or one scale per row
    when the block scales are replicated (``replicated_block_scales``)."""
    group = fp8_group(request)
    if group is not None and replicated_block_scales(request):
        return 1, group[1]
    return group


class CpuFp8Avx512Linear(LinearMethod):
    """FP8 E4M3 W8A16 linear for x86 CPUs with AVX512-BF16: the weight stays 8-bit in memory
    and is converted to bf16 in registers (exactly), dot products accumulate in fp32, each
    K block's partial sum is multiplied by its scale once. AMX tiles serve M >= 8 where the
    CPU reports amx_bf16 + amx_tile and the OS grants tile data (``kernels.AMX_MIN_M``).

    Float32 activations are accepted and rounded to bf16 on entry (the output stays fp32);
    the rounding (2^-9 relative) is far below the FP8 weights' own step (2^-4).
    """

    name: ClassVar[str] = "cpu-fp8-avx512"
    api_version: ClassVar[str] = "1.0"
    priority: ClassVar[int] = 50
    summary: ClassVar[str] = ("FP8 E4M3 W8A16 (per-tensor / per-block scales) on x86 "
                              "AVX512-BF16 CPUs, AMX where present")

    @classmethod
    def can_implement(cls, request: LinearRequest, device: DeviceCapability) -> Verdict:
        s = request.scheme
        n, k = request.out_features, request.in_features
        handles = Verdict.all(
            Verdict.handles(s.name in _FP8_SCHEMES,
                            f"handles schemes {_FP8_SCHEMES}, layer is {s.describe()}"),
            # "bfloat16" is QuantScheme's default: a scheme that names no element type.
            Verdict.handles(s.weight_dtype in ("float8_e4m3fn", "bfloat16"),
                            f"handles float8_e4m3fn weights, scheme has {s.weight_dtype!r}"),
            # Routed experts are cpu-fp8-moe's (kernelbay_cpu_amx.moe).
            Verdict.handles(request.num_experts is None,
                            f"handles dense layers only, request stacks {request.num_experts} "
                            "experts"),
        )
        if not handles:
            return handles
        group = fp8_group(request)
        layout = s.option("weight_layout", "nk")
        shape_checks = [Verdict.check(n % N_MULTIPLE == 0,
                                      f"N={n} is not a multiple of {N_MULTIPLE}")]
        if group is None:
            shape_checks.append(Verdict.check(k % K_BLOCK_MULTIPLE == 0,
                                              f"K={k} is not a multiple of {K_BLOCK_MULTIPLE}"))
        else:
            bn, bk = group
            shape_checks += [
                Verdict.check(bk > 0 and bk % K_BLOCK_MULTIPLE == 0,
                              f"needs a K block that is a multiple of {K_BLOCK_MULTIPLE}, "
                              f"group_shape is {group}"),
                Verdict.check(bk > 0 and k % bk == 0,
                              f"K={k} is not a multiple of the K block {bk}"),
                Verdict.check(bn == 1 or (bn > 0 and bn % 16 == 0),
                              f"needs 1 or a multiple of 16 rows of N per scale, group_shape "
                              f"is {group}"),
            ]
        verdict = Verdict.all(
            *device_checks(device),
            Verdict.check(s.activation in _ACTIVATION_SCHEMES,
                          f"needs activation scheme in {_ACTIVATION_SCHEMES} (W8A16), scheme "
                          f"has {s.activation!r}"),
            Verdict.check(request.activation_dtype in _FP8_ACTIVATION_DTYPES,
                          f"needs activation dtype in {_FP8_ACTIVATION_DTYPES}, request has "
                          f"{request.activation_dtype!r}"),
            Verdict.check(layout in _LAYOUTS,
                          f"needs scheme option weight_layout in {_LAYOUTS}, got {layout!r}"),
            *shape_checks,
        )
        if not verdict:
            return verdict
        notes = [_path_note(device)]
        if s.activation is not None:
            notes.append(f"weight-only: activations stay bf16 ({s.activation} not applied)")
        if request.activation_dtype == "float32":
            notes.append("float32 activations are rounded to bf16 on entry")
        return Verdict.accept(*notes)

    def tensor_specs(self) -> Mapping[str, TensorSpec]:
        r = self.request
        n, k = r.out_features, r.in_features
        group = fp8_group(r)
        shard = self.weight_shard_dim
        scale_shard = None if group is None else shard
        scale_rows = n
        if replicated_block_scales(r):
            scale_shard, scale_rows = None, n * r.tp_size  # the whole grid, on every rank
        if weight_layout(r) == "kn":
            # Stored transposed: [K, N] and a [K/bk, N/bn] grid; the split dim flips too.
            flip = None if scale_shard is None else 1 - scale_shard
            scale_kn: tuple[int, ...] = () if group is None else _grid(k, scale_rows,
                                                                        group[::-1])
            specs = {"weight": TensorSpec((k, n), "float8_e4m3fn",
                                          None if shard is None else 1 - shard),
                     "weight_scale": TensorSpec(scale_kn, "float32", flip)}
        else:
            scale_nk: tuple[int, ...] = () if group is None else _grid(scale_rows, k, group)
            specs = {"weight": TensorSpec((n, k), "float8_e4m3fn", shard),
                     "weight_scale": TensorSpec(scale_nk, "float32", scale_shard)}
        if r.scheme.activation == "fp8-static":
            # The checkpoint carries a static activation scale; W8A16 reads and ignores it.
            specs["input_scale"] = TensorSpec((), "float32", None)
        specs.update(self.bias_specs())
        return specs

    def _canonical(self, layer: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """The loaded weight as [N, K] E4M3 and its scale as [ceil(N/bn), K/bk] (or [])."""
        import torch

        r = self.request
        n, k = r.out_features, r.in_features
        group = fp8_group(r)
        weight = cast("torch.Tensor", layer.weight).detach()
        scale = cast("torch.Tensor", layer.weight_scale).detach().to(torch.float32)
        if weight.dtype == torch.uint8:
            weight = weight.view(torch.float8_e4m3fn)
        if weight.dtype != torch.float8_e4m3fn:
            raise TypeError(f"{self.name}: weight dtype must be float8_e4m3fn (or its uint8 "
                            f"bits), got {weight.dtype}")
        scale_rows = n * r.tp_size if replicated_block_scales(r) else n
        transposed = _orientation(tuple(weight.shape), tuple(scale.shape), n, k, group,
                                  weight_layout(r), scale_rows)
        if transposed:
            weight = weight.t()
            if group is not None:
                scale = scale.t()
        if group is not None and tuple(scale.shape) != _grid(scale_rows, k, group):
            raise ValueError(f"{self.name}: weight_scale has shape {tuple(scale.shape)}, a "
                             f"[{scale_rows}, {k}] weight with blocks {group} needs "
                             f"{_grid(scale_rows, k, group)}")
        if group is not None and scale_rows != n:
            # This rank's rows n0 .. n0 + n - 1 each take their block's scale row.
            rows = (torch.arange(n) + r.tp_rank * n) // group[0]
            scale = scale[rows]
        if group is None and scale.numel() != 1:
            raise ValueError(f"{self.name}: a per-tensor weight_scale has one element, got "
                             f"shape {tuple(scale.shape)}")
        return weight.contiguous(), scale

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Canonicalise to [N, K], pack for the kernels, make the scale operand; once."""
        import torch

        from kernelbay_cpu_amx import kernels

        weight, scale = self._canonical(layer)
        group = kernel_group(self.request)
        packed = kernels.pack_weight(weight)
        operand = kernels.scale_operand(scale, group)
        layer.weight = torch.nn.Parameter(packed, requires_grad=False)
        layer.weight_scale = torch.nn.Parameter(operand, requires_grad=False)
        _store_bias(layer)
        kernels.extension()  # build (or load) the kernels now, not in the first forward

    def packed(self, layer: torch.nn.Module) -> PackedLinear:
        """The layer's kernel operands (after ``process_weights_after_loading``)."""
        from kernelbay_cpu_amx.kernels import PackedLinear

        r = self.request
        bias = None if self.rank_bias(layer) is None else getattr(layer, "bias_f32", None)
        return PackedLinear(cast("torch.Tensor", layer.weight),
                            cast("torch.Tensor", layer.weight_scale), kernel_group(r), bias,
                            r.out_features, r.in_features)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        from kernelbay_cpu_amx import kernels

        return kernels.linear(self.packed(layer), x)


def _orientation(weight_shape: tuple[int, ...], scale_shape: tuple[int, ...], n: int, k: int,
                 group: tuple[int, int] | None, declared: str, scale_rows: int) -> bool:
    """True when the loaded tensors are [K, N] (to transpose), from what they show.

    1. A non-square weight says it by its shape. 2. A square one with block scales: the scale
    grid [ceil(N/bn), ceil(K/bk)] vs its transpose, when they differ. 3. Otherwise the
    declared layout (scheme option ``weight_layout``, default ``"nk"``). Shapes that fit
    neither orientation raise.
    """
    nk, kn = (n, k), (k, n)
    if weight_shape not in (nk, kn):
        raise ValueError(f"weight has shape {list(weight_shape)}, expected [N, K] = {list(nk)} "
                         f"or [K, N] = {list(kn)}")
    evidence: bool | None = None
    if nk != kn:
        evidence = weight_shape == kn
    elif group is not None:
        grid_nk = _grid(scale_rows, k, group)
        grid_kn = _grid(k, scale_rows, group[::-1])
        if grid_nk != grid_kn and scale_shape in (grid_nk, grid_kn):
            evidence = scale_shape == grid_kn
    if evidence is None:
        return declared == "kn"
    return evidence


def _store_bias(layer: torch.nn.Module) -> None:
    import torch

    bias = getattr(layer, "bias", None)
    if bias is not None:
        layer.register_buffer("bias_f32", bias.detach().to(torch.float32).contiguous(),
                              persistent=False)


class CpuBf16Avx512Linear(LinearMethod):
    """Unquantized bf16 linear through the same AVX512-BF16 kernels (weights packed once into
    the dot-product layout); offered because it beats ``F.linear`` on this class of CPU at
    decode sizes (bench/cpu_fp8)."""

    name: ClassVar[str] = "cpu-bf16-avx512"
    api_version: ClassVar[str] = "1.0"
    priority: ClassVar[int] = 20
    summary: ClassVar[str] = "unquantized bf16 linear on x86 AVX512-BF16 CPUs (packed weights)"

    @classmethod
    def can_implement(cls, request: LinearRequest, device: DeviceCapability) -> Verdict:
        s = request.scheme
        n, k = request.out_features, request.in_features
        handles = Verdict.all(
            Verdict.handles(not s.is_quantized,
                            f"handles unquantized weights only, layer is {s.describe()}"),
            Verdict.handles(request.num_experts is None,
                            f"handles dense layers only, request stacks {request.num_experts} "
                            "experts"),
        )
        if not handles:
            return handles
        verdict = Verdict.all(
            *device_checks(device),
            Verdict.check(request.activation_dtype == "bfloat16",
                          f"needs activation dtype 'bfloat16' (the weights' dtype), request has "
                          f"{request.activation_dtype!r}"),
            Verdict.check(n % N_MULTIPLE == 0, f"N={n} is not a multiple of {N_MULTIPLE}"),
            Verdict.check(k % K_BLOCK_MULTIPLE == 0,
                          f"K={k} is not a multiple of {K_BLOCK_MULTIPLE}"),
        )
        return Verdict.accept(_path_note(device)) if verdict else verdict

    def tensor_specs(self) -> Mapping[str, TensorSpec]:
        r = self.request
        return {"weight": TensorSpec((r.out_features, r.in_features), "bfloat16",
                                     self.weight_shard_dim),
                **self.bias_specs()}

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Pack the [N, K] bf16 weight into the kernels' layout, once."""
        import torch

        from kernelbay_cpu_amx import kernels

        weight = cast("torch.Tensor", layer.weight).detach()
        n, k = self.request.out_features, self.request.in_features
        if tuple(weight.shape) != (n, k):
            raise ValueError(f"{self.name}: weight has shape {list(weight.shape)}, expected "
                             f"[N, K] = {[n, k]}")
        layer.weight = torch.nn.Parameter(kernels.pack_weight(weight.to(torch.bfloat16)),
                                          requires_grad=False)
        # A unit scale, constant along K: the kernels' per-tensor form.
        layer.register_buffer("unit_scale", torch.ones((), dtype=torch.float32),
                              persistent=False)
        _store_bias(layer)
        kernels.extension()

    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        from kernelbay_cpu_amx import kernels

        r = self.request
        bias = None if self.rank_bias(layer) is None else getattr(layer, "bias_f32", None)
        packed = kernels.PackedLinear(cast("torch.Tensor", layer.weight),
                                      cast("torch.Tensor", layer.unit_scale), None, bias,
                                      r.out_features, r.in_features)
        return kernels.linear(packed, x)
