"""Shared test helpers: random E4M3 codes and scales, the float64 reference built on
``kernelbay.formats.fp8``, and the derived error bound (see test_kernels.py's docstring)."""

from __future__ import annotations

import torch
from kernelbay.formats.fp8 import dequantize_fp8_per_block, dequantize_fp8_per_tensor

#: CPU flags the compiled kernels need (the ``cpu_isa`` marker skips elsewhere).
KERNEL_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")


def random_codes(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Every finite E4M3 code (zeros, subnormals, +-448 included), uniformly; no NaN."""
    codes = torch.randint(0, 254, (n, k), generator=gen, dtype=torch.int64)
    codes = codes + (codes >= 0x7F).long()  # 0..253 -> every code but the NaNs 0x7F, 0xFF
    return codes.to(torch.uint8).view(torch.float8_e4m3fn)


def make_scale(n: int, k: int, group: tuple[int, int] | None,
               gen: torch.Generator) -> torch.Tensor:
    if group is None:
        return torch.rand((), generator=gen) * 0.1 + 1e-3
    rows, cols = -(-n // group[0]), k // group[1]
    return torch.exp2(torch.randint(-12, 3, (rows, cols), generator=gen).float()) * (
        1 + torch.rand(rows, cols, generator=gen))


def reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
              group: tuple[int, int] | None, bias: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, magnitude) in float64 from the bf16-rounded x and the reference dequantization."""
    if group is None:
        w = dequantize_fp8_per_tensor(q, scale).double()
    else:
        w = dequantize_fp8_per_block(q, scale, group).double()
    xd = x.to(torch.bfloat16).double()
    y = xd @ w.t()
    mag = xd.abs() @ w.abs().t()
    if bias is not None:
        y = y + bias.double()
        mag = mag + bias.double().abs()
    return y, mag


def assert_within_bound(out: torch.Tensor, y: torch.Tensor, mag: torch.Tensor, k: int,
                        num_k_blocks: int) -> None:
    e32 = (k + num_k_blocks + 4) * 2.0**-24 * mag
    bound = e32 if out.dtype == torch.float32 else e32 + 2.0**-8 * (y.abs() + e32)
    err = (out.double() - y).abs()
    worst = (err - bound).max().item()
    assert worst <= 0, (f"error exceeds the bf16-accumulation bound by {worst:.3g} "
                        f"(max err {err.max().item():.3g}, |y| max {y.abs().max().item():.3g})")


def packed_layer(q: torch.Tensor, scale: torch.Tensor, group: tuple[int, int] | None,
                 bias: torch.Tensor | None) -> object:
    from kernelbay_cpu_amx import kernels

    n, k = q.shape
    return kernels.PackedLinear(kernels.pack_weight(q), kernels.scale_operand(scale, group),
                                group, None if bias is None else bias.float(), n, k)


def write_hf_fp8_llama(path: str, *, block: tuple[int, int] | None = (128, 128),
                       exclude: list[str] | None = None, transposed: tuple[str, ...] = (),
                       seed: int = 0) -> str:
    """A tiny Llama in the Hugging Face fine-grained FP8 dialect: every linear but ``lm_head``
    (and ``exclude``) stored as E4M3 ``weight`` + ``weight_scale_inv``, quantized by the
    reference; modules named in ``transposed`` are written [K, N] like a column-major
    exporter would. Returns ``path``."""
    import json
    import os

    from kernelbay.checkpoint.layout import plain_linear_modules
    from kernelbay.checkpoint.tensors import read_safetensors_header
    from kernelbay.formats.fp8 import quantize_fp8_per_block, quantize_fp8_per_tensor
    from kernelbay.testing.checkpoints import write_checkpoint, write_tiny_llama
    from safetensors.torch import load_file

    src = write_tiny_llama(os.path.join(path, "_bf16"), seed=seed, hidden_size=128,
                           intermediate_size=256, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=256)
    shard = os.path.join(src, "model.safetensors")
    tensors = load_file(shard)
    modules = plain_linear_modules(read_safetensors_header(shard))
    for module in modules:
        if module.name == "lm_head" or module.name in (exclude or []):
            continue
        dense = tensors[f"{module.name}.weight"].float()
        q, s = (quantize_fp8_per_tensor(dense) if block is None
                else quantize_fp8_per_block(dense, block))
        if module.name in transposed:
            q, s = q.t().contiguous(), s.t().contiguous() if s.dim() == 2 else s
        tensors[f"{module.name}.weight"] = q
        tensors[f"{module.name}.weight_scale_inv"] = s
    with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    quant: dict[str, object] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                "weight_block_size": None if block is None else list(block)}
    if exclude:
        quant["modules_to_not_convert"] = exclude
    config["quantization_config"] = quant
    return write_checkpoint(os.path.join(path, "fp8"), config, tensors)
