"""``nvfp4-w4a4-native``: W4A4 NVFP4 on FP4 tensor cores (compute capability 10.x) through
``torch._scaled_mm`` with ``float4_e2m1fn_x2`` operands and swizzled E4M3 block scales.

Math (FORMATS.md; ModelOpt's NVFP4 W4A4 recipe):

    xq, xs  = NVFP4(x, global = input_scale)      per 16 along K: xs = e4m3(amax_b / (6 * input_scale)),
                                                   codes = e2m1(x / (float(xs) * input_scale))
    acc     = sum_k e2m1(xq) * xs  *  e2m1(wq) * ws   (the FP4 GEMM; block scales applied inside)
    y       = acc * alpha (+ b),   alpha = input_scale * weight_scale_2

Block-scale layout: the FP4 GEMM wants each operand's [rows, K/16] scales in 128 x 4 tiles
("blocked" layout of cuBLAS block scaling): rows and scale columns padded with zeros to
multiples of 128 and 4; tiles in row-major order over (row tile, column tile); inside a tile
scale (r, c) sits at byte ``(r % 32) * 16 + (r // 32) * 4 + c``. ``swizzle_block_scales`` makes
it, ``unswizzle_block_scales`` undoes it.

Everything here except ``apply`` runs on any device, so the pieces are tested on CPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar, cast

from kernelbay.layers.linear import LinearMethod, TensorSpec
from kernelbay.requests import LinearRequest
from kernelbay.verdict import Verdict

from kernelbay_quant_nvfp4.schemes import NVFP4_BLOCK, W4A4_ACTIVATION, dense_only

if TYPE_CHECKING:
    import torch
    from kernelbay.device import DeviceCapability

__all__ = ["Nvfp4NativeW4A4Linear", "quantize_activations_nvfp4", "swizzle_block_scales",
           "unswizzle_block_scales", "w4a4_alpha"]

_ACT_DTYPES = ("bfloat16", "float16")
#: Rows and scale columns of one swizzled tile.
TILE_ROWS, TILE_COLS = 128, 4


def swizzle_block_scales(scales: torch.Tensor) -> torch.Tensor:
    """``scales [R, C]`` (E4M3, row-major) -> the flat blocked layout ``[ceil(R/128) * 128 *
    ceil(C/4) * 4]`` the FP4 GEMM reads (zero padding)."""
    import torch.nn.functional as F

    rows, cols = scales.shape
    rt, ct = -(-rows // TILE_ROWS), -(-cols // TILE_COLS)
    bits = scales.view(torch_uint8()) if scales.element_size() == 1 else scales
    padded = F.pad(bits, (0, ct * TILE_COLS - cols, 0, rt * TILE_ROWS - rows))
    # [rt, 4 (r // 32), 32 (r % 32), ct, 4 (c)] -> [rt, ct, r % 32, r // 32, c]
    tiles = padded.reshape(rt, 4, 32, ct, TILE_COLS).permute(0, 3, 2, 1, 4)
    return tiles.reshape(-1).contiguous().view(scales.dtype)


def unswizzle_block_scales(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of ``swizzle_block_scales``: the row-major ``[rows, cols]`` scales."""
    rt, ct = -(-rows // TILE_ROWS), -(-cols // TILE_COLS)
    bits = flat.view(torch_uint8()) if flat.element_size() == 1 else flat
    tiles = bits.reshape(rt, ct, 32, 4, TILE_COLS).permute(0, 3, 2, 1, 4)
    full = tiles.reshape(rt * TILE_ROWS, ct * TILE_COLS)
    return full[:rows, :cols].contiguous().view(flat.dtype)


def torch_uint8() -> torch.dtype:
    """``torch.uint8`` (imported lazily)."""
    import torch

    return torch.uint8


# E2M1 midpoints: a magnitude passes an even-indexed one when strictly above it and an
# odd-indexed one when at or above it (ties go to the even code), as kernelbay.formats.e2m1.
_EVEN_MIDPOINTS = (0.25, 1.25, 2.5, 5.0)
_ODD_MIDPOINTS = (0.75, 1.75, 3.5)


def quantize_activations_nvfp4(x: torch.Tensor, input_scale: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic NVFP4 activations with the static ``input_scale`` as the global scale (what
    ModelOpt's W4A4 recipe and FP4 kernels compute): ``x [M, K]`` -> (packed uint8 [M, K/2],
    block scales float8_e4m3fn [M, K/16]).

    Per 16 elements: ``s = amax / (6 * input_scale)`` (1.0 for an all-zero block), ``xs =
    e4m3(s)`` (saturating at 448), code = E2M1 round-to-nearest-even of ``x / (float(xs) *
    input_scale)`` saturating at 6, code 0 in a block whose scale rounds to zero. Two
    ``bucketize`` passes replace the reference's seven comparisons; bytes equal the
    reference ``kernelbay.formats.quantize_nvfp4(x, input_scale)``.
    """
    import torch

    m, k = x.shape
    if k % NVFP4_BLOCK:
        raise ValueError(f"quantize_activations_nvfp4: K={k} is not a multiple of the NVFP4 "
                         f"block {NVFP4_BLOCK}")
    g = input_scale.float().reshape(())
    xb = x.float().reshape(m, k // NVFP4_BLOCK, NVFP4_BLOCK)
    s = xb.abs().amax(dim=-1) / (6.0 * g)
    s = torch.where(s == 0, 1.0, s).clamp(max=448.0)
    xs = s.to(torch.float8_e4m3fn)
    scale = (xs.float() * g).unsqueeze(-1)
    q = xb / scale
    mag = q.abs()
    even = torch.tensor(_EVEN_MIDPOINTS, device=x.device)
    odd = torch.tensor(_ODD_MIDPOINTS, device=x.device)
    code = (torch.bucketize(mag, even, right=False)
            + torch.bucketize(mag, odd, right=True)).to(torch.uint8)
    code = code | (torch.signbit(q).to(torch.uint8) << 3)
    code = torch.where(scale == 0, 0, code).to(torch.uint8).reshape(m, k)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    return packed, xs


def w4a4_alpha(input_scale: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
    """``alpha = input_scale * weight_scale_2`` (fp32, 0-d): the factor the FP4 GEMM's
    output needs, both global scales being outside the block-scaled product."""
    return (input_scale.float() * weight_scale_2.float()).reshape(())


class Nvfp4NativeW4A4Linear(LinearMethod):
    """NVFP4 W4A4 on compute capability 10.x: activations quantized per call with the
    static ``input_scale``, both operands' block scales in the swizzled layout, then
    ``torch._scaled_mm`` on FP4 tensor cores and the ``alpha`` rescale."""

    name: ClassVar[str] = "nvfp4-w4a4-native"
    api_version: ClassVar[str] = "1.0"
    priority: ClassVar[int] = 40
    summary: ClassVar[str] = ("NVFP4 W4A4 on FP4 tensor cores (torch._scaled_mm, swizzled "
                              "E4M3 block scales); compute capability 10.x")

    @classmethod
    def can_implement(cls, request: LinearRequest, device: DeviceCapability) -> Verdict:
        s = request.scheme
        n, k = request.out_features, request.in_features
        cc = device.compute_capability
        return Verdict.all(
            dense_only(request),
            Verdict.handles(s.name == "nvfp4" and s.activation == W4A4_ACTIVATION,
                            f"handles NVFP4 W4A4 (activations {W4A4_ACTIVATION!r}) only, layer "
                            f"is {s.describe()}"),
            Verdict.check(s.group_shape == (1, NVFP4_BLOCK) and s.scale_dtype == "float8_e4m3fn",
                          f"needs NVFP4 blocks of 1x{NVFP4_BLOCK} with float8_e4m3fn scales, "
                          f"scheme has group {s.group_shape} with {s.scale_dtype!r} scales"),
            Verdict.check(device.platform == "cuda" and cc is not None and cc[0] == 10,
                          f"needs FP4 tensor cores of compute capability 10.x, device is "
                          f"{device.platform} {device.arch} (compute capability "
                          f"{device.cc_text})"),
            Verdict.check(request.activation_dtype in _ACT_DTYPES,
                          f"needs activation dtype in {_ACT_DTYPES}, request has "
                          f"{request.activation_dtype!r}"),
            # cuBLASLt wants 16-byte aligned rows of packed FP4: K/2 a multiple of 16.
            Verdict.check(k > 0 and k % 32 == 0,
                          f"K={k} is not a multiple of 32 (16-byte rows of packed FP4)"),
            Verdict.check(n > 0 and n % 16 == 0, f"N={n} is not a multiple of 16"),
        )

    def tensor_specs(self) -> Mapping[str, TensorSpec]:
        r = self.request
        n, k = r.out_features, r.in_features
        dim = self.weight_shard_dim
        return {
            "weight": TensorSpec((n, k // 2), "uint8", dim),
            "weight_scale": TensorSpec((n, k // NVFP4_BLOCK), "float8_e4m3fn", dim),
            "weight_scale_2": TensorSpec((), "float32", None),
            "input_scale": TensorSpec((), "float32", None),
            **self.bias_specs(),
        }

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Swizzle the weight's block scales once (buffer ``weight_scale_swizzled``) and fold
        the two global scales into ``alpha``."""
        from kernelbay_quant_nvfp4.linear_triton import check_finite_scales

        scales = cast("torch.Tensor", layer.weight_scale).data
        glob = cast("torch.Tensor", layer.weight_scale_2).data
        check_finite_scales(self.name, scales, glob)
        layer.register_buffer("weight_scale_swizzled", swizzle_block_scales(scales),
                              persistent=False)
        layer.register_buffer("alpha", w4a4_alpha(cast("torch.Tensor", layer.input_scale).data,
                                                  glob), persistent=False)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        import torch

        k, n = self.request.in_features, self.request.out_features
        lead = x.shape[:-1]
        x2 = x.reshape(-1, k)
        xq, xs = quantize_activations_nvfp4(x2, cast("torch.Tensor", layer.input_scale))
        fp4 = torch.float4_e2m1fn_x2
        out = torch._scaled_mm(xq.view(fp4), cast("torch.Tensor", layer.weight).view(fp4).t(),
                               scale_a=swizzle_block_scales(xs),
                               scale_b=cast("torch.Tensor", layer.weight_scale_swizzled),
                               out_dtype=torch.bfloat16)
        # torch's FP4 path documents bf16 output; alpha is applied in fp32 after it.
        out = out.float() * cast("torch.Tensor", layer.alpha)
        bias = self.rank_bias(layer)
        if bias is not None:
            out = out + bias.float()
        return out.to(x.dtype).reshape(*lead, n)

    def dequantized_weight(self, layer: torch.nn.Module) -> torch.Tensor:
        """The dense weight in the activation dtype, through the reference."""
        import torch
        from kernelbay.formats import dequantize_nvfp4

        w = dequantize_nvfp4(cast("torch.Tensor", layer.weight),
                             cast("torch.Tensor", layer.weight_scale),
                             cast("torch.Tensor", layer.weight_scale_2))
        return w.to(getattr(torch, self.request.activation_dtype))
