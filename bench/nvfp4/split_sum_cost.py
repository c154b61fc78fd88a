"""What the split-K sum costs the CUDA wgmma GEMM: each default split build timed as called
(the GEMM kernel, then ``triton_kernels.sum_partials``), without the sum (partials written,
never added: not a valid result, a timing only), and the sum kernel alone, in CUDA graphs
with the weight copies rotated past the L2 as bench/nvfp4/run.py does.

    python bench/nvfp4/split_sum_cost.py
"""

from __future__ import annotations

import os
import sys

import torch
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from l2_rotation import copies_for, rotating  # from bench/, put on the path above
from settle import settle

CASES = ((8192, 8192, 64), (8192, 28672, 64), (8192, 8192, 128), (8192, 28672, 128))


def time_case(n: int, k: int, m: int) -> str:
    """One line: the default build for ``m`` x ``n`` x ``k`` as called, without the sum, and
    the sum kernel alone (us)."""
    from kernelbay.formats import quantize_nvfp4
    from kernelbay_quant_nvfp4 import cuda_wgmma, triton_kernels
    from kernelbay_quant_nvfp4.linear_triton import layout_tensors

    real = triton_kernels.sum_partials
    packed, scales, g = quantize_nvfp4(torch.randn(n, k, device="cuda"))
    words, codes = layout_tensors(packed, scales, "tiles")
    config = cuda_wgmma.config_for_m(m, n, k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    scale = g.reshape(1)
    copies = [(words, codes)] + [(words.clone(), codes.clone())
                                 for _ in range(copies_for(words.nbytes + codes.nbytes) - 1)]
    call = rotating([lambda w=w, c=c: cuda_wgmma.launch_wgmma(x, w, c, scale, None, config)
                     for w, c in copies])
    us = {}
    try:
        for label, summed in (("as called", real), ("without the sum", None)):
            # cuda_wgmma imports sum_partials from the module at each call
            triton_kernels.sum_partials = summed or (lambda part, bias, out: out)
            call()
            settle()
            us[label] = 1e3 * triton.testing.do_bench_cudagraph(call, rep=20,
                                                                  return_mode="median")
    finally:
        triton_kernels.sum_partials = real
    part = torch.randn(config.split, m, n, device="cuda")
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    settle()
    us["sum kernel alone"] = 1e3 * triton.testing.do_bench_cudagraph(
        lambda: real(part, None, out), rep=20, return_mode="median")
    return (f"{n} x {k}, M = {m}, {config.name}: "
            + ", ".join(f"{label} {t:.2f} us" for label, t in us.items()))


def main() -> int:
    for n, k, m in CASES:
        print(time_case(n, k, m), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
