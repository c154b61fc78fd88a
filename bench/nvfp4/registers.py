"""Compile every ``nvfp4-triton`` kernel config for a GPU architecture without a GPU and print
its registers, spill stack and shared memory (``cuobjdump -res-usage`` of the cubin), and
with ``--loop`` the instructions of its K loop per weight element and row tile (the
largest backward branch of the ``nvdisasm`` listing, times the threads, over
BLOCK_N x BLOCK_K): the numbers behind ``triton_configs``. Needs triton's bundled
ptxas/cuobjdump/nvdisasm; no GPU.

    python bench/nvfp4/registers.py            # sm_90, bf16 and fp16 activations
    python bench/nvfp4/registers.py --loop --dtypes bf16
    python bench/nvfp4/registers.py --arch 100
"""

from __future__ import annotations

import argparse
import collections
import inspect
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import sm90_tools  # from bench/, put on the path above


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability as 90, 100 ...")
    p.add_argument("--loop", action="store_true",
                   help="also count the K loop's instructions per weight element")
    p.add_argument("--dtypes", default="bf16,fp16", help="activation dtypes, e.g. bf16")
    p.add_argument("--configs", default="",
                   help="comma-separated config name prefixes (default: every candidate)")
    args = p.parse_args(argv)
    import triton
    from kernelbay_quant_nvfp4 import triton_halfword as th
    from kernelbay_quant_nvfp4.triton_configs import CANDIDATES
    from triton.compiler import ASTSource

    target = sm90_tools.target(args.arch)

    def loop(kernel: Any, c: Any) -> str:
        body = sm90_tools.loop_body(sm90_tools.disassemble(kernel.asm["cubin"]))
        ops = collections.Counter(sm90_tools.opcode(i).split(".")[0] for i in body)
        per = len(body) * 32 * c.num_warps / (c.block_n * c.block_k)
        return (f" loop {len(body)} instr, {per:.2f}/element; "
                + " ".join(f"{k}:{v}" for k, v in ops.most_common(8)))

    prefixes = tuple(x for x in args.configs.split(",") if x)
    failed = 0
    for dt in args.dtypes.split(","):
        for c in CANDIDATES:
            if c.path in ("dequant", "cuda", "cuda-tiles"):  # the CUDA GEMV: cuda_gemv
                continue
            if prefixes and not c.name.startswith(prefixes):
                continue
            for partial in (True, False):
                fn = th.nvfp4_matmul_hw
                names = list(inspect.signature(fn.fn).parameters)
                w_type = "*i32" if c.path in ("pairs", "repacked", "fragment", "tiles") else "*i16"
                types = {"x_ptr": f"*{dt}", "w_ptr": w_type, "s_ptr": "*u8", "g_ptr": "*fp32",
                         "b_ptr": f"*{dt}", "out_ptr": "*fp32" if partial else f"*{dt}"}
                const: dict[str, Any] = {"HAS_BIAS": not partial, "BLOCK_M": c.block_m,
                                         "BLOCK_N": c.block_n, "BLOCK_K": c.block_k,
                                         "PARTIAL": partial, "ASM": True, "EVEN_K": True,
                                         "INTERPRET": False, "PAIRS": c.path == "pairs",
                                         "REPACKED": c.path in ("repacked", "fragment", "tiles"),
                                         "SWAP": c.path in ("fragment", "tiles"),
                                         "TILED": c.path == "tiles"}
                sig = {n: "constexpr" if n in const else types.get(n, "i32") for n in names}
                # Pointers, strides and K divisible by 16, as the launcher specializes them
                # for real shapes (without it, loads are not vectorized nor pipelined).
                div = [n for n in names if n not in const
                       and (n.endswith("_ptr") or n.startswith("stride") or n == "K")]
                src = ASTSource(fn=fn, signature=sig,
                                constexprs={(names.index(n),): v for n, v in const.items()},
                                attrs={(names.index(n),): [["tt.divisibility", 16]]
                                       for n in div})
                try:
                    kernel = triton.compile(src, target=target, options={
                        "num_warps": c.num_warps, "num_stages": c.num_stages})
                except Exception as exc:  # report and go on: one config, not the table
                    failed += 1
                    print(f"{dt} {c.name} {'partial' if partial else 'direct'}: FAILED "
                          f"{str(exc)[:300]}", flush=True)
                    continue
                regs = sm90_tools.registers(kernel.asm["cubin"])
                print(f"{dt} {c.name} {'partial' if partial else 'direct'}: {regs} "
                      f"SHARED:{kernel.metadata.shared}"
                      + (loop(kernel, c) if args.loop else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
