"""Compile the batch-invariant matmul kernel (``kernels._matmul_kernel``) for a GPU
architecture without a GPU and print, per candidate tiling of ``run.SHAPE_CANDIDATES`` and per way
of summing split-K slices, its registers, spill stack and shared memory (``cuobjdump
-res-usage``), and whether the K loop runs its MMAs asynchronously (Hopper wgmma left in
flight across iterations: the software pipeline is in place). Needs triton's bundled
ptxas/cuobjdump; no GPU.

    python bench/batch_invariant/registers.py            # sm_90
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import sm90_tools  # from bench/, put on the path above

#: Integer arguments that are multiples of 16 at the benchmark's shapes.
_DIVISIBLE = {"N", "K", "K_PER_SPLIT", "stride_xm", "stride_wn", "stride_ys", "stride_ym"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability as 90, 100 ...")
    args = p.parse_args(argv)
    import triton
    from kernelbay_batch_invariant import kernels
    from triton.compiler import ASTSource

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from run import SHAPE_CANDIDATES

    target = sm90_tools.target(args.arch)

    fn = kernels._matmul_kernel
    names = list(inspect.signature(fn.fn).parameters)
    types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "ws_ptr": "*fp32", "lock_ptr": "*i32"}
    failed = 0
    every = dict.fromkeys(c for cands in SHAPE_CANDIDATES.values() for c in cands)
    for bm, bn, bk, warps, split_stages, split, in_kernel, split_tma, whole_tma, whole_st \
            in every:
        ways = [("one", True, False, 1)] if split == 1 else (
            [("whole", True, False, 1), ("split", False, in_kernel, 1)])
        if split >= 4 and split % 2 == 0:  # two slices a program (mid M: kernels.py)
            ways.append(("split pairs", False, in_kernel, 2))
        for way, whole, sum_in, group in ways:
            # The whole-tile mode may load and pipeline differently (config.whole_tma / stages).
            tma = split_tma or (whole and whole_tma)
            stages = whole_st if whole and whole_st else split_stages
            # As the launcher specializes them: unit K strides (constants), 16-divisible
            # pointers, sizes and row strides; without that the loads would not vectorize
            # and the pipeliner would not stage them through shared memory as on the GPU.
            const: dict[str, Any] = {
                "stride_xk": 1, "stride_wk": 1, "stride_yn": 1,
                "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "IEEE": False,
                "USE_DOT": True, "EVEN_K": True, "SPLITS": split, "WHOLE_TILE": whole,
                "SUM_IN_KERNEL": sum_in, "TMA": tma, "GROUP": group}
            y = "*bf16" if whole or sum_in else "*fp32"
            loads = ({"x_ptr": f"tensordesc<bf16[{bm}, {bk}]>",
                      "w_ptr": f"tensordesc<bf16[{bn}, {bk}]>"} if tma else {})
            sig = {n: "constexpr" if n in const else
                   loads.get(n, y if n == "y_ptr" else types.get(n, "i32")) for n in names}
            aligned = {(names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items()
                       if t.startswith("*") or n in _DIVISIBLE}
            src = ASTSource(fn=fn, signature=sig,
                            constexprs={(names.index(n),): v for n, v in const.items()},
                            attrs=aligned)
            what = (f"{bm}x{bn}x{bk} w{warps} s{stages} split{split}"
                    f"{' ik' if in_kernel else ''}{' tma' if tma else ''} {way}")
            try:
                kernel = triton.compile(src, target=target, options={
                    "num_warps": warps, "num_stages": stages})
            except Exception as exc:  # report and go on: one config, not the sweep
                failed += 1
                print(f"{what}: FAILED {str(exc)[:300]}", flush=True)
                continue
            ttgir = kernel.asm.get("ttgir", "")
            asyncs = ttgir.count("isAsync = true") if args.arch == 90 else -1
            copies = ttgir.count("async_tma_copy_global_to_local")
            regs = sm90_tools.registers(kernel.asm["cubin"])
            print(f"{what:44s} {regs} SHARED:{kernel.metadata.shared} "
                  f"async-wgmma:{asyncs} tma-copies:{copies}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
