"""Compile ``mla-triton`` decode-kernel launch configurations for a GPU architecture without a
GPU and print registers, spill stack, shared memory and the KV-tile loop's size (SASS
instructions per iteration, per thread): the numbers behind the kernel's defaults and the bench's sweep. Needs triton's
bundled ptxas/cuobjdump/nvdisasm.

    python bench/mla_decode/registers.py                       # sm_90, the sweep's configs
    python bench/mla_decode/registers.py --kinds mxfp8 --block-n 32,64 --warps 4,8
    python bench/mla_decode/registers.py --kinds mxfp8 --block-n 32 --warps 4 --stages 2 --ops
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
from collections import Counter
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import sm90_tools  # from bench/, put on the path above


def _usage(cubin: bytes) -> tuple[str, int, Counter[str]]:
    """``REG:n STACK:n`` of the cubin, its tile loop's SASS instruction count and opcodes
    (the largest loop: the decode kernel's KV-tile loop, where the per-element
    dequantization cost shows: conversions, permutes, packed multiplies)."""
    body = sm90_tools.loop_body(sm90_tools.disassemble(cubin, check=False))
    return sm90_tools.registers(cubin), len(body), Counter(map(sm90_tools.opcode, body))


def compile_config(kind: str, heads: int, block_n: int, warps: int, stages: int,
                   arch: int = 90, **extra: Any) -> Any:
    """The compiled decode kernel for ``kind`` (FORMATS.md dims) at one launch configuration
    (the constexprs ``triton_mla.launch_constants`` gives the GPU launch)."""
    import triton
    from kernelbay_attn_flashmla import triton_kernels as tk
    from kernelbay_attn_flashmla.records import RECORDS
    from kernelbay_attn_flashmla.triton_mla import launch_constants
    from triton.compiler import ASTSource

    record = RECORDS[kind]
    extra.setdefault("sparse", False)
    const = launch_constants(record, heads, 64, record.page_bytes(64), block_n=block_n,
                             fast_fp8=True, interpreting=False, **extra)
    names = list(inspect.signature(tk.mla_decode_kernel.fn).parameters)
    ptrs = {"q_ptr": "*bf16", "cache_u8": "*u8",
            "block_tables": "*i32", "tok_seq": "*i32", "tok_len": "*i32", "tok_start": "*i32",
            "topk_ptr": "*i32", "out_ptr": "*fp32", "lse_ptr": "*fp32", "sm_scale": "fp32"}
    sig = {n: "constexpr" if n in const else ptrs.get(n, "i32") for n in names}
    # Pointers are 16-byte aligned at every launch (torch allocations), which the launcher
    # specializes on: said here too, or the loads would not vectorize as on the GPU.
    aligned = {(names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items()
               if t.startswith("*")}
    src = ASTSource(fn=tk.mla_decode_kernel, signature=sig,
                    constexprs={(names.index(n),): v for n, v in const.items()},
                    attrs=aligned)
    return triton.compile(src, target=sm90_tools.target(arch),
                          options={"num_warps": warps, "num_stages": stages})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--kinds", default="bf16,fp8,fp8-e8m0,mxfp8")
    p.add_argument("--heads", default="16")
    p.add_argument("--block-n", default="16,32,64")
    p.add_argument("--warps", default="4,8")
    p.add_argument("--stages", default="1,2,3")
    p.add_argument("--grouped", default="auto", choices=["auto", "yes", "no"])
    p.add_argument("--reg-prefetch", default="yes", choices=["yes", "no"])
    p.add_argument("--ttgir", action="store_true", help="print whether loads go async")
    p.add_argument("--f16-dot", default="no", choices=["yes", "no"],
                   help="quantized records decoded and dotted in float16")
    p.add_argument("--ops", action="store_true",
                   help="print the tile loop's most frequent SASS opcodes")
    a = p.parse_args(argv)
    failed = 0
    grouped = {"auto": None, "yes": True, "no": False}[a.grouped]
    for kind in a.kinds.split(","):
        for heads in map(int, a.heads.split(",")):
            for bn in map(int, a.block_n.split(",")):
                for w in map(int, a.warps.split(",")):
                    for st in map(int, a.stages.split(",")):
                        label = f"{kind} H={heads} block_n={bn} warps={w} stages={st}"
                        try:
                            k = compile_config(kind, heads, bn, w, st, a.arch,
                                               grouped=grouped,
                                               reg_prefetch=a.reg_prefetch == "yes",
                                               f16_dot=a.f16_dot == "yes")
                        except Exception as exc:  # one config, not the table
                            failed += 1
                            print(f"{label}: FAILED {str(exc)[:300]}", flush=True)
                            continue
                        usage, n, ops = _usage(k.asm["cubin"])
                        extra = ""
                        if a.ttgir:
                            ir = k.asm["ttgir"]
                            extra = (f" async_copies={ir.count('async_copy_global_to_local')}"
                                     f" converts={ir.count('convert_layout')}")
                        print(f"{label}: {usage} SHARED:{k.metadata.shared} LOOP:{n}{extra}",
                              flush=True)
                        if a.ops:
                            print("  " + " ".join(f"{op}:{c}" for op, c in ops.most_common(16)),
                                  flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
