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
import re
import subprocess
import sys
import tempfile
from typing import Any


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability as 90, 100 ...")
    p.add_argument("--loop", action="store_true",
                   help="also count the K loop's instructions per weight element")
    p.add_argument("--dtypes", default="bf16,fp16", help="activation dtypes, e.g. bf16")
    args = p.parse_args(argv)
    import triton
    from kernelbay_quant_nvfp4 import triton_halfword as th
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

    def loop(kernel: Any, c: Any) -> str:
        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
            f.write(kernel.asm["cubin"])
        text = subprocess.run([os.path.join(os.path.dirname(cuobjdump), "nvdisasm"), "-c",
                               f.name], capture_output=True, text=True, check=True).stdout
        os.unlink(f.name)
        body = loop_body(text)
        ops = collections.Counter(op.split(".")[0] for op in body)
        per = len(body) * 32 * c.num_warps / (c.block_n * c.block_k)
        return (f" loop {len(body)} instr, {per:.2f}/element; "
                + " ".join(f"{k}:{v}" for k, v in ops.most_common(8)))

    failed = 0
    for dt in args.dtypes.split(","):
        for c in CANDIDATES:
            if c.path != "fused":
                continue
            for partial in (True, False):
                fn = th.nvfp4_matmul_hw
                names = list(inspect.signature(fn.fn).parameters)
                types = {"x_ptr": f"*{dt}", "w_ptr": "*i16", "s_ptr": "*u8", "g_ptr": "*fp32",
                         "b_ptr": f"*{dt}", "out_ptr": "*fp32" if partial else f"*{dt}"}
                const: dict[str, Any] = {"HAS_BIAS": not partial, "BLOCK_M": c.block_m,
                                         "BLOCK_N": c.block_n, "BLOCK_K": c.block_k,
                                         "PARTIAL": partial, "ASM": True, "EVEN_K": True,
                                         "INTERPRET": False}
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
                print(f"{dt} {c.name} {'partial' if partial else 'direct'}: {usage(kernel)} "
                      f"SHARED:{kernel.metadata.shared}"
                      + (loop(kernel, c) if args.loop else ""), flush=True)
    return 1 if failed else 0


def loop_body(sass: str) -> list[str]:
    """Opcodes (predicates dropped) of the largest loop in an ``nvdisasm -c`` listing: the
    instructions from a label to the furthest backward branch to it."""
    labels: dict[str, int] = {}
    pending: str | None = None
    instrs: list[tuple[int, str]] = []
    for line in sass.splitlines():
        label = re.match(r"^\s*\.(L_x_\d+):", line)
        if label:
            pending = label.group(1)
            continue
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if not m:
            continue
        addr = int(m.group(1), 16)
        if pending:
            labels[pending], pending = addr, None
        instrs.append((addr, re.sub(r"^@!?U?P\w+\s+", "", m.group(2).strip())))
    best = (0, -1)
    for addr, text in instrs:
        target = re.search(r"BRA.*`\(\.(L_x_\d+)\)", text)
        start = labels.get(target.group(1), addr) if target else addr
        if start < addr and addr - start > best[1] - best[0]:
            best = (start, addr)
    return [t.split()[0] for a, t in instrs if best[0] <= a <= best[1]]


if __name__ == "__main__":
    sys.exit(main())
