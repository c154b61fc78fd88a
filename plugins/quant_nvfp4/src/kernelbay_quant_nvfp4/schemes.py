"""The quant schemes this plugin's formats hand out, and the header checks behind
``linear_modules`` (torch-free: only safetensors header entries are read)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

from kernelbay.errors import CheckpointError
from kernelbay.requests import QuantScheme
from kernelbay.verdict import Verdict

if TYPE_CHECKING:
    from kernelbay.checkpoint.tensors import TensorInfo
    from kernelbay.layers.checkpoint_format import LinearModule
    from kernelbay.requests import LinearRequest

__all__ = [
    "FLOAT_DTYPES",
    "FP8_BLOCK_MODELOPT",
    "FP8_MODELOPT",
    "NVFP4_BLOCK",
    "W4A4_ACTIVATION",
    "check_linear",
    "dense_only",
    "k_in_blocks",
    "nvfp4_layer_checks",
    "nvfp4_scheme",
]

NVFP4_BLOCK = 16
FLOAT_DTYPES = ("float32", "bfloat16", "float16")
#: The activation of W4A4 NVFP4 schemes: dynamic NVFP4 with ``input_scale`` as global scale.
W4A4_ACTIVATION = "nvfp4-dynamic"


def nvfp4_scheme(dialect: str, w4a4: bool) -> QuantScheme:
    """NVFP4 weights (E2M1, E4M3 scales per 1x16, an fp32 global scale); ``w4a4`` when the
    checkpoint carries ``input_scale`` for dynamic NVFP4 activations."""
    return QuantScheme("nvfp4", "e2m1", (1, NVFP4_BLOCK), "float8_e4m3fn", True,
                       W4A4_ACTIVATION if w4a4 else None, dialect)


def dense_only(request: LinearRequest) -> Verdict:
    """Not applicable to routed-expert requests (the MoE methods take those)."""
    return Verdict.handles(request.num_experts is None,
                           f"handles dense layers only, request is a routed-expert MLP of "
                           f"{request.num_experts} experts")


def k_in_blocks(request: LinearRequest) -> Verdict:
    """This rank's K in whole NVFP4 blocks (so block scales shard with the weight)."""
    k = request.in_features
    return Verdict.check(k > 0 and k % NVFP4_BLOCK == 0,
                         f"K={k} is not a multiple of the NVFP4 block {NVFP4_BLOCK}")


def nvfp4_layer_checks(scheme: QuantScheme, layers: str, activations: str) -> Verdict:
    """What every NVFP4 method asks of a layer's scheme: NVFP4 at all (else not applicable:
    "handles NVFP4 ``layers`` only"), 1x16 blocks with E4M3 scales, and activations None or
    dynamic NVFP4 (``activations`` says what the method does with them)."""
    s = scheme
    return Verdict.all(
        Verdict.handles(s.name == "nvfp4", f"handles NVFP4 {layers} only, layer is {s.describe()}"),
        Verdict.check(s.group_shape == (1, NVFP4_BLOCK) and s.scale_dtype == "float8_e4m3fn",
                      f"needs NVFP4 blocks of 1x{NVFP4_BLOCK} with float8_e4m3fn scales, "
                      f"scheme has group {s.group_shape} with {s.scale_dtype!r} scales"),
        Verdict.check(s.activation in (None, W4A4_ACTIVATION),
                      f"{activations}, scheme has {s.activation!r}"),
    )


#: ModelOpt ``FP8``: E4M3 weight, one fp32 weight scale, a static fp32 input scale.
FP8_MODELOPT = QuantScheme("fp8", "float8_e4m3fn", None, "float32", False, "fp8-static",
                           "modelopt")
#: ModelOpt ``FP8_PB_WO``: E4M3 weight, fp32 scales per 128x128 tile, bf16 activations.
#: ModelOpt's exporter writes no block-size field for it (its recipe fixes 128x128), so the
#: tile is checked against the ``weight_scale`` shape in ``check_linear``.
FP8_BLOCK_MODELOPT = QuantScheme("fp8-block", "float8_e4m3fn", (128, 128), "float32", False,
                                 None, "modelopt")


def _need(tensors: Mapping[str, TensorInfo], weight: TensorInfo, checkpoint_name: str,
          why: str) -> TensorInfo:
    info = tensors.get(checkpoint_name)
    if info is None:
        raise CheckpointError(weight.file, f"is missing; {why}", tensor=checkpoint_name)
    return info


def check_linear(module: LinearModule, scheme: QuantScheme, tensors: Mapping[str, TensorInfo],
                 weight_name: str, names: Mapping[str, str], reason: str) -> LinearModule:
    """Check one linear module's header entries against its scheme; return it with its
    logical shape (K = 2 * packed width for E2M1 weights).

    ``names`` maps canonical tensor names (``weight_scale``, ``weight_scale_2``) to checkpoint
    names; ``reason`` says why the scheme applies (shown in errors). Raises
    ``CheckpointError`` naming the file and tensor on any mismatch.
    """
    w = tensors[weight_name]
    n, cols = w.shape
    if not scheme.is_quantized:
        if w.dtype not in FLOAT_DTYPES:
            raise CheckpointError(w.file, f"is stored as {w.dtype}, but the config leaves this "
                                  f"layer unquantized ({reason}); expected one of "
                                  f"{FLOAT_DTYPES}", tensor=weight_name)
        return module
    if scheme.name == "nvfp4":
        if w.dtype != "uint8":
            raise CheckpointError(w.file, f"is stored as {w.dtype}, but the config quantizes "
                                  f"this layer as NVFP4 ({reason}), which packs two E2M1 "
                                  "codes per uint8", tensor=weight_name)
        k = 2 * cols
        scale = _need(tensors, w, names["weight_scale"],
                      f"NVFP4 layer {module.name!r} needs its E4M3 block scales")
        want = (n, -(-k // NVFP4_BLOCK))
        if scale.dtype != "float8_e4m3fn" or scale.shape != want:
            raise CheckpointError(scale.file, f"is {scale.dtype} {list(scale.shape)}, but NVFP4 "
                                  f"weight [{n}, {cols}] (K={k}) needs float8_e4m3fn "
                                  f"{list(want)}", tensor=names["weight_scale"])
        glob = _need(tensors, w, names["weight_scale_2"],
                     f"NVFP4 layer {module.name!r} needs its fp32 global scale")
        if glob.numel != 1:
            raise CheckpointError(glob.file, f"has shape {list(glob.shape)}, but a global scale "
                                  "is one fp32 value", tensor=names["weight_scale_2"])
        return replace(module, in_features=k)
    if w.dtype != "float8_e4m3fn":
        raise CheckpointError(w.file, f"is stored as {w.dtype}, but the config quantizes this "
                              f"layer as {scheme.describe()} ({reason}); expected "
                              "float8_e4m3fn", tensor=weight_name)
    scale = _need(tensors, w, names["weight_scale"],
                  f"FP8 layer {module.name!r} needs its fp32 weight scale")
    if scheme.group_shape is None:
        if scale.numel != 1:
            raise CheckpointError(scale.file, f"has shape {list(scale.shape)}, but FP8 "
                                  "per-tensor needs one fp32 scale", tensor=names["weight_scale"])
    else:
        bn, bk = scheme.group_shape
        want = (-(-n // bn), -(-cols // bk))
        if scale.shape != want:
            raise CheckpointError(scale.file, f"has shape {list(scale.shape)}, but FP8 weight "
                                  f"[{n}, {cols}] in {bn}x{bk} tiles needs {list(want)}",
                                  tensor=names["weight_scale"])
    return module
