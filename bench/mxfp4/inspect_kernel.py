"""Compile the MXFP4 GEMM for a GPU architecture without a GPU (triton's bundled ptxas and
nvdisasm) and report, per config, what decides its speed at small M: the layout conversions
and shared-memory round trips inside the K loop (TTGIR), registers, and the SASS instructions
of the K loop per weight element per thread (the loop is the body between the loop label and its
backward branch).

    python bench/mxfp4/inspect_kernel.py                     # the M <= 16 candidates, sm_90
    python bench/mxfp4/inspect_kernel.py --m 64 --dump DIR   # also write ttgir/ptx/sass
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import sm90_tools  # from bench/, put on the path above


def compile_config(cfg: Any, a_kind: int, arch: int, split: bool) -> Any:
    """The compiled kernel of one config (triton.compile on an ASTSource, no GPU)."""
    import triton
    from kernelbay_quant_mxfp4_rocm import triton_gemm as tg
    from triton.compiler import ASTSource

    fn = tg._mxfp4_gemm_kernel
    names = list(inspect.signature(fn.fn).parameters)
    const = tg.kernel_constexprs(cfg, a_kind, k_even=True, split=split, interpret=False,
                                 out_bits=False)
    scaled = cfg.path == "scaled"
    a_type = {0: "*bf16", 1: "*u8" if scaled else "*i16", 2: "*u8"}[a_kind]
    w_type = "*u8" if scaled else "*i32" if cfg.path in ("pairs", "repacked", "fragment") else "*i16"
    types = {"a_ptr": a_type, "as_ptr": "*u8", "w_ptr": w_type,
             "ws_ptr": "*u8",
             "out_ptr": "*fp32" if split else "*bf16"}
    sig = {n: "constexpr" if n in const else types.get(n, "i32") for n in names}
    # what a launch specializes on real tensors: 16-byte aligned pointers, strides and sizes
    # divisible by 16 (without it the loads are not vectorized)
    aligned = ("a_ptr", "as_ptr", "w_ptr", "ws_ptr", "out_ptr", "N", "K", "stride_am",
               "stride_asm", "stride_wn", "stride_wsn", "stride_om", "stride_os")
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned if n in names}
    src = ASTSource(fn=fn, signature=sig,
                    constexprs={(names.index(n),): v for n, v in const.items()}, attrs=attrs)
    return triton.compile(src, target=sm90_tools.target(arch),
                          options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})


def loop_stats(sass: str) -> dict[str, int]:
    """Instruction counts of the largest loop (label .. backward BRA to it) of the SASS."""
    # Only register predicates dropped: a never-run placeholder (``@!PT LDS RZ, [RZ]``) is
    # a loop instruction but no shared-memory load, so it counts under no opcode.
    ops = [re.sub(r"^@!?U?P\d\s+", "", i).split()[0].split(".")[0]
           for i in sm90_tools.loop_body(sass)]
    out = {"loop": len(ops)}
    for key in ("HMMA", "LDS", "STS", "LDSM", "LDG", "BAR", "F2F", "PRMT", "LOP3", "SHF",
                "HMUL2", "HFMA2", "FMUL", "I2F", "F2FP", "IMAD", "SEL"):
        out[key] = sum(1 for o in ops if o == key)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--m", type=int, default=1, help="M whose candidate configs to compile")
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--k", type=int, default=8192)
    p.add_argument("--a-kind", type=int, default=0, help="0 bf16, 1 MXFP4, 2 MXFP8")
    p.add_argument("--only", default="", help="comma-separated config names")
    p.add_argument("--dump", default="", help="folder for ttgir/ptx/sass per config")
    args = p.parse_args(argv)
    from kernelbay_quant_mxfp4_rocm.triton_gemm import candidate_configs, default_config

    cfgs = [default_config(args.m, args.n, args.k, layout="fragment")]
    cfgs += [c for c in candidate_configs(args.m, args.n, args.k) if c != cfgs[0]]
    if args.only:
        cfgs = [c for c in cfgs if c.describe() in args.only.split(",")]
    failed = 0
    for cfg in cfgs:
        if cfg.path == "dequant":  # torch's matmul after a decode kernel
            continue
        try:
            kernel = compile_config(cfg, args.a_kind, args.arch, cfg.split_k > 1)
        except Exception as exc:  # one config's failure is a row, not the end
            failed += 1
            print(f"{cfg.describe()}: FAILED {str(exc)[:300]}", flush=True)
            continue
        ttgir = kernel.asm["ttgir"]
        sass = sm90_tools.disassemble(kernel.asm["cubin"], line_info=True)
        st = loop_stats(sass)
        per_tile = cfg.block_n * cfg.block_k // (32 * cfg.num_warps)  # per thread
        body = ttgir[ttgir.find("scf.for"):]
        cvt = body.count("ttg.convert_layout")
        alloc = body.count("ttg.local_alloc")
        regs = sm90_tools.registers(kernel.asm["cubin"])
        print(f"{cfg.describe()}: {regs} "
              f"smem {kernel.metadata.shared} | loop SASS {st['loop']} = "
              f"{st['loop'] / per_tile:.2f}/weight elem | cvt {cvt} alloc {alloc} | "
              + " ".join(f"{k}:{v}" for k, v in st.items() if k != "loop" and v), flush=True)
        if args.dump:
            d = Path(args.dump)
            d.mkdir(parents=True, exist_ok=True)
            (d / f"{cfg.describe()}.ttgir").write_text(ttgir)
            (d / f"{cfg.describe()}.ptx").write_text(kernel.asm["ptx"])
            (d / f"{cfg.describe()}.sass").write_text(sass)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
