"""``mxfp4-triton`` (ROCm gfx942/gfx950) and ``mxfp4-triton-cuda`` (CUDA, only when forced):
OCP MXFP4 linear layers on the Triton kernels of ``triton_gemm`` / ``triton_mx``.

Math (the same as ``mxfp4-emulation``, which is the reference the tests compare with)::

    weight-only:   y = mxfp4_gemm(x, weight, weight_scale) + b            float32 -> bf16
    W4A4 / W4A8:   xq, xs = triton_mx.quantize_mx(x, elem, rule)          dynamic, per 32
                   y = (mxfp4_gemm(xq, weight, weight_scale, x_scale=xs) + b)   float32
                   -> x's dtype

The GEMM dequantizes both operands in registers to bf16 (exact) and accumulates in float32,
so the result is the emulation's up to float32 summation order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, cast

from kernelbay.requests import LinearRequest
from kernelbay.verdict import Verdict

from kernelbay_quant_mxfp4_rocm.devices import native_note, rocm_home, triton_present
from kernelbay_quant_mxfp4_rocm.emulation import (
    Mxfp4EmulationLinear,
    dense_mx_checks,
)

if TYPE_CHECKING:
    import torch
    from kernelbay.device import DeviceCapability

__all__ = ["CUDA_FORCE_NOTE", "Mxfp4TritonCudaLinear", "Mxfp4TritonLinear"]

#: The verdict note of the CUDA candidate.
CUDA_FORCE_NOTE = ("ROCm-first kernel on CUDA: chosen only when forced "
                   "(KERNELBAY_FORCE_LINEAR=mxfp4-triton-cuda), to verify the kernels")


def _tensor(layer: torch.nn.Module, name: str) -> torch.Tensor:
    """The data of the layer's parameter or buffer ``name``."""
    value = getattr(layer, name)
    return cast("torch.Tensor", value.data)


def _triton_checks(request: LinearRequest) -> Verdict:
    return Verdict.all(
        dense_mx_checks(request),
        Verdict.check(request.activation_dtype == "bfloat16",
                      f"needs bfloat16 activations (the kernels' MMA type), request has "
                      f"{request.activation_dtype!r}"),
        triton_present(),
    )


class Mxfp4TritonLinear(Mxfp4EmulationLinear):
    """OCP MXFP4 linear on Triton for ROCm gfx942/gfx950: the packed weight is dequantized in
    registers inside the GEMM (split-K GEMV for M <= 16, tiles beyond); dynamic MX
    activations are quantized by a Triton kernel with the config's scale rule."""

    name: ClassVar[str] = "mxfp4-triton"
    api_version: ClassVar[str] = "1.0"
    priority: ClassVar[int] = 50
    summary: ClassVar[str] = "OCP MXFP4 (W4A16/W4A4/W4A8) Triton GEMM, weights dequantized in registers"

    @classmethod
    def can_implement(cls, request: LinearRequest, device: DeviceCapability) -> Verdict:
        verdict = Verdict.all(_triton_checks(request), rocm_home(device))
        if not verdict.accepted:
            return verdict
        return Verdict.accept(*verdict.notes, native_note(device), cls._activation_note(request))

    @staticmethod
    def _activation_note(request: LinearRequest) -> str:
        s = request.scheme
        if s.activation is None:
            return ""
        return (f"activations quantized {s.activation} by Triton "
                f"(scale rule {s.option('scale_mode', 'even')})")

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Check the weight scales once and keep their largest finite byte on the layer
        (``mxfp4_scale_max``: at most 128 selects the GEMM's single-multiply decode), and store
        the packed weight in the layout the GEMM reads best here (``prepare_weight``: the
        fragment-order words where the PTX decode runs, after tensor-parallel sharding)."""
        from kernelbay_quant_mxfp4_rocm.triton_gemm import prepare_weight, prepare_weight_scales

        top = prepare_weight_scales(_tensor(layer, "weight_scale"), f"{self.name}: weight_scale")
        object.__setattr__(layer, "mxfp4_scale_max", top)  # a plain int beside the tensors
        layer.weight.data = prepare_weight(_tensor(layer, "weight"))

    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        import torch

        from kernelbay_quant_mxfp4_rocm import triton_mx
        from kernelbay_quant_mxfp4_rocm.triton_gemm import mxfp4_gemm

        weight, scale = _tensor(layer, "weight"), _tensor(layer, "weight_scale")
        top = getattr(layer, "mxfp4_scale_max", None)
        bias = self.rank_bias(layer)
        x2 = x.reshape(-1, x.shape[-1])
        elem = self._activation_elem
        xs = None
        if elem is not None:
            rule = self.request.scheme.option("scale_mode", "even") or "even"
            x2, xs = triton_mx.quantize_mx(x2, elem, rule)
        if bias is None:  # float32 sums rounded once to x's dtype
            y = mxfp4_gemm(x2, weight, scale, x_scale=xs, out_dtype=x.dtype, scale_max=top)
        else:  # one rounding after the bias, as F.linear
            y32 = mxfp4_gemm(x2, weight, scale, x_scale=xs, out_dtype=torch.float32,
                             scale_max=top)
            y = (y32 + bias.float()).to(x.dtype)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def dequantized_weight(self, layer: torch.nn.Module) -> torch.Tensor:
        """The weight dequantized by the reference, in the activation dtype (MLA)."""
        import torch
        from kernelbay.formats import checkpoint_layout, dequantize_mx

        # stored as fragment-order words where the PTX decode runs (prepare_weight)
        w = dequantize_mx(checkpoint_layout(_tensor(layer, "weight")),
                          _tensor(layer, "weight_scale"), "e2m1")
        return w.to(getattr(torch, self.request.activation_dtype))


class Mxfp4TritonCudaLinear(Mxfp4TritonLinear):
    """The ``mxfp4-triton`` kernels on CUDA, to verify and benchmark them on NVIDIA GPUs: the
    lowest priority, so chosen only when ``KERNELBAY_FORCE_LINEAR=mxfp4-triton-cuda``."""

    name: ClassVar[str] = "mxfp4-triton-cuda"
    api_version: ClassVar[str] = "1.0"
    priority: ClassVar[int] = 0
    summary: ClassVar[str] = "mxfp4-triton on CUDA, only when forced (KERNELBAY_FORCE_LINEAR)"

    @classmethod
    def can_implement(cls, request: LinearRequest, device: DeviceCapability) -> Verdict:
        verdict = Verdict.all(
            _triton_checks(request),
            Verdict.check(device.platform == "cuda",
                          f"is the CUDA verification build of mxfp4-triton, device is "
                          f"{device.platform} {device.arch}"),
        )
        if not verdict.accepted:
            return verdict
        return Verdict.accept(*verdict.notes, CUDA_FORCE_NOTE, cls._activation_note(request))
