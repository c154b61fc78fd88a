"""Benchmark: how fast this GPU can only read a weight's bytes, the ceiling of any weight-only
kernel at decode batch sizes (no decode, no multiply: each byte loaded once and XORed away).

Two reading kernels, each over buffers of the NVFP4 weight sizes of ``bench/nvfp4`` (37.1 MB
for 8192 x 8192 and 132 MB for 28672 x 8192; plus one 468 MB buffer) rotating over enough
copies to exceed twice the L2:

* ``v4``: every thread loads 16-byte vectors (``ld.global.nc.v4``) over a grid-stride loop, at
  2 to 16 CTAs per SM;
* ``bulk``: each CTA streams its contiguous share through a ring of shared-memory stages
  filled by bulk copies (TMA, sm_90), at 1 to 4 CTAs per SM.

The fastest time for a weight's bytes bounds the NVFP4 ratio against bf16 from above: bf16
time / floor time. Timed as ``bench/nvfp4`` times (CUDA graph, after 0.25 s of idle GPU).

    python bench/nvfp4/read_floor.py --out bench/results/nvfp4-read-floor-h200
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from l2_rotation import copies_for, rotating  # from bench/, put on the path above
from report import write_results
from settle import settle

SOURCE = r'''
#include "kernelbay/ptx.cuh"
extern "C" __global__ void read_v4(const uint4* __restrict__ p, long long n16, unsigned* out) {
  unsigned acc = 0;
  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  const long long step = (long long)gridDim.x * blockDim.x;
#pragma unroll 4
  for (; i < n16; i += step) {
    uint4 v;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p + i));
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) out[0] = acc;   // keeps the loads
}

extern "C" __global__ void read_bulk(const unsigned char* __restrict__ p, long long per, int S,
                                     int CH, unsigned* out) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) unsigned long long bars[32];
  const unsigned char* src = p + blockIdx.x * per;
  const int n = (int)(per / CH);
  const u32 base = (u32)__cvta_generic_to_shared(smem);
  const u32 bar0 = (u32)__cvta_generic_to_shared(bars);
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) mbar_init(bar0 + 8 * s, 1);
    mbar_init_fence();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int s = 0; s < S && s < n; ++s) {
      mbar_expect(bar0 + 8 * s, CH);
      bulk_copy(base + s * CH, src + (long long)s * CH, CH, bar0 + 8 * s);
    }
  }
  unsigned acc = 0;
  for (int i = 0; i < n; ++i) {
    const int s = i % S;
    mbar_wait(bar0 + 8 * s, (i / S) & 1);
    acc ^= lds32(base + s * CH + (threadIdx.x * 16) % CH);
    __syncthreads();
    if (threadIdx.x == 0 && i + S < n) {
      mbar_expect(bar0 + 8 * s, CH);
      bulk_copy(base + s * CH, src + (long long)(i + S) * CH, CH, bar0 + 8 * s);
    }
  }
  if (acc == 0x12345678u) out[0] = acc;
}
'''

#: (CTAs per SM, threads) of the vector kernel; (CTAs per SM, stages, stage bytes) of the
#: bulk kernel.
V4_SHAPES = ((2, 512), (4, 256), (8, 256), (16, 256))
BULK_SHAPES = ((1, 8, 16384), (1, 12, 16384), (2, 6, 16384), (2, 12, 8192), (4, 6, 8192),
               (1, 24, 8192))
#: Buffer sizes (MiB): the NVFP4 weights of 8192 x 8192 and 28672 x 8192, and a large one.
SIZES_MIB = (37.75, 132.0, 470.0)


def main(argv: list[str] | None = None) -> int:
    """Run the reading kernels and write results.json / results.md under ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/nvfp4-read-floor")
    parser.add_argument("--rep-ms", type=int, default=20)
    args = parser.parse_args(argv)

    import torch
    import triton
    import triton.testing
    from kernelbay.cuda_jit import compile_cubin, load_kernel

    if not torch.cuda.is_available():
        print("read_floor: needs a CUDA GPU", file=sys.stderr)
        return 2
    major, minor = torch.cuda.get_device_capability(0)
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    torch.zeros(1, device="cuda")   # the primary context the loaded modules live in
    arch = f"sm_{major}{minor}"
    v4 = load_kernel(compile_cubin(SOURCE, "read_v4", arch, []), "read_v4", 0)
    bulk = load_kernel(compile_cubin(SOURCE, "read_bulk", arch, []), "read_bulk", 0)
    bulk.set_max_dynamic_shared(max(s * ch for _, s, ch in BULK_SHAPES))
    out = torch.zeros(4, dtype=torch.int32, device="cuda")

    def time_us(fns: list[Any]) -> float:
        settle()
        with torch.cuda.stream(torch.cuda.Stream()):
            return float(triton.testing.do_bench_cudagraph(rotating(fns), rep=args.rep_ms)) * 1e3

    rows: list[dict[str, Any]] = []
    for mib in SIZES_MIB:
        nbytes = int(mib * 2**20) // (sms * 16384) * (sms * 16384)
        bufs = [torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
                for _ in range(copies_for(nbytes))]

        def stream() -> int:
            return torch.cuda.current_stream().cuda_stream

        for per_sm, threads in V4_SHAPES:
            fns = [lambda b=b, c=per_sm, t=threads, nb=nbytes: v4.launch(
                (sms * c, 1, 1), (t, 1, 1), [ctypes.c_void_p(b.data_ptr()),
                                             ctypes.c_longlong(nb // 16),
                                             ctypes.c_void_p(out.data_ptr())], stream(), 0)
                   for b in bufs]
            t = time_us(fns)
            rows.append({"kernel": f"v4 {per_sm} CTAs/SM x {threads}", "bytes": nbytes,
                         "us": t, "gbps": nbytes / t / 1e3})
        for per_sm, stages, chunk in BULK_SHAPES:
            ctas = sms * per_sm
            per = nbytes // ctas // chunk * chunk
            fns = [lambda b=b, c=ctas, p=per, s=stages, ch=chunk: bulk.launch(
                (c, 1, 1), (128, 1, 1), [ctypes.c_void_p(b.data_ptr()), ctypes.c_longlong(p),
                                         ctypes.c_int(s), ctypes.c_int(ch),
                                         ctypes.c_void_p(out.data_ptr())], stream(), s * ch)
                   for b in bufs]
            t = time_us(fns)
            rows.append({"kernel": f"bulk {per_sm} CTAs/SM, {stages} x {chunk // 1024} KB",
                         "bytes": per * ctas, "us": t, "gbps": per * ctas / t / 1e3})
        print(f"{nbytes / 1e6:.1f} MB: fastest {min(r['us'] for r in rows[-10:]):.1f} us",
              flush=True)
        del bufs
    result = {"benchmark": "read-only floor for weight streaming",
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": props.name, "sms": sms, "torch": torch.__version__,
              "triton": triton.__version__, "rows": rows}
    lines = [f"# Read-only floor for weight streaming ({result['device']})", "",
             f"{result['date']}, torch {result['torch']}, triton {result['triton']}; CUDA graph "
             "timing after 0.25 s idle, buffers rotated past twice the L2.", "",
             "| MB | kernel | us | GB/s |", "| ---: | --- | ---: | ---: |"]
    lines += [f"| {r['bytes'] / 1e6:.1f} | {r['kernel']} | {r['us']:.2f} | {r['gbps']:.0f} |"
              for r in rows]
    return write_results(args.out, result, "\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
