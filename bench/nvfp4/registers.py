"""Compile every ``nvfp4-triton`` kernel config for a GPU architecture without a GPU and print
its registers, spill stack and shared memory (``cuobjdump -res-usage`` of the cubin): the
numbers behind ``triton_configs.DEFAULT_CONFIGS``. Needs triton's bundled ptxas/cuobjdump.

    python bench/nvfp4/registers.py            # sm_90, bf16 and fp16 activations
    python bench/nvfp4/registers.py --arch 100
"""

from __future__ import annotations

import argparse
import inspect
import os
import subprocess
import sys
import tempfile
from typing import Any


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability as 90, 100 ...")
    args = p.parse_args(argv)
    import triton
    from kernelbay_quant_nvfp4 import triton_kernels as tk
    from kernelbay_quant_nvfp4.triton_configs import CANDIDATES
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", args.arch, 32)
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                             "cuobjdump")

    def usage(kernel: Any) -> str:
        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
            f.write(kernel.asm["cubin"])
        out = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
        os.unlink(f.name)
        line = next(x for x in out.splitlines() if "REG" in x).split()
        return f"{line[0]} {line[1]}"

    failed = 0
    for dt in ("bf16", "fp16"):
        for c in CANDIDATES:
            if c.path != "fused":
                continue
            for partial in (True, False):
                fn = tk.nvfp4_matmul_w8 if c.decode8 else tk.nvfp4_matmul
                names = list(inspect.signature(fn.fn).parameters)
                types = {"x_ptr": f"*{dt}", "w_ptr": "*i32" if c.decode8 else "*u8",
                         "s_ptr": "*u8", "g_ptr": "*fp32", "b_ptr": f"*{dt}",
                         "out_ptr": "*fp32" if partial else f"*{dt}"}
                const: dict[str, Any] = {"HAS_BIAS": not partial, "BLOCK_M": c.block_m,
                                         "BLOCK_N": c.block_n, "BLOCK_K": c.block_k,
                                         "PARTIAL": partial}
                const.update({"ASM": True} if c.decode8 else
                             {"DOT_FP32": False, "DOT16": c.dot16})
                sig = {n: "constexpr" if n in const else types.get(n, "i32") for n in names}
                src = ASTSource(fn=fn, signature=sig,
                                constexprs={(names.index(n),): v for n, v in const.items()})
                try:
                    kernel = triton.compile(src, target=target, options={
                        "num_warps": c.num_warps, "num_stages": c.num_stages})
                except Exception as exc:  # report and go on: one config, not the table
                    failed += 1
                    print(f"{dt} {c.name} {'partial' if partial else 'direct'}: FAILED "
                          f"{str(exc)[:300]}", flush=True)
                    continue
                print(f"{dt} {c.name} {'partial' if partial else 'direct'}: {usage(kernel)} "
                      f"SHARED:{kernel.metadata.shared}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
