"""Run one ``nvfp4-triton`` kernel config a few times on random weights (for a profiler):
``python bench/nvfp4/one_config.py NAME N K M [REPEATS]``."""

from __future__ import annotations

import sys

import torch
from kernelbay.formats import quantize_nvfp4
from kernelbay_quant_nvfp4.linear_triton import layout_tensors, run_config
from kernelbay_quant_nvfp4.triton_configs import CANDIDATES, layout_of


def main() -> int:
    name, n, k, m = sys.argv[1], *map(int, sys.argv[2:5])
    repeats = int(sys.argv[5]) if len(sys.argv) > 5 else 5
    config = next(c for c in CANDIDATES if c.name == name)
    packed, scales, g = quantize_nvfp4(torch.randn(n, k, device="cuda"))
    weight, codes = layout_tensors(packed, scales, layout_of(config))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    for _ in range(repeats):
        run_config(config, x, weight, codes, g.reshape(1), None)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
