// kernelbay/ptx.cuh: PTX wrappers shared by the CUDA sources that kernelbay.cuda_jit compiles
// (every source can `#include "kernelbay/ptx.cuh"`; the header travels with the core and is
// part of each cubin's cache key). Shared-memory operands are 32-bit shared-window addresses
// (__cvta_generic_to_shared).

#pragma once

typedef unsigned int u32;

// --- asynchronous copies, global -> shared (sm_80+) ---

__device__ __forceinline__ void copy16(u32 dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(src));
}

// copy16 where ``pred`` is nonzero, else nothing: one predicated instruction, no branch (the
// source address is not read when the predicate is off).
__device__ __forceinline__ void copy16_if(u32 pred, u32 dst, const void* src) {
  asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.u32 p, %2, 0;\n\t"
               "@p cp.async.cg.shared.global [%0], [%1], 16;\n\t}"
               :: "r"(dst), "l"(src), "r"(pred));
}

// 16 bytes of which the first ``src_bytes`` are read and the rest zero-filled (0: a zeroed slot).
__device__ __forceinline__ void copy16_fill(u32 dst, const void* src, u32 src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src),
               "r"(src_bytes));
}

__device__ __forceinline__ void copy4(u32 dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" :: "r"(dst), "l"(src));
}

__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;"); }

// Until at most N of this thread's committed copy groups are still in flight.
template <int N>
__device__ __forceinline__ void wait_groups() { asm volatile("cp.async.wait_group %0;" :: "n"(N)); }

// --- bulk (TMA) copies completing on an mbarrier (sm_90+) ---

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}

// One arrival that also announces ``bytes`` of bulk copies completing on ``bar``.
__device__ __forceinline__ void mbar_expect(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}

// Until the phase of parity ``parity`` of ``bar`` has completed (its copies landed).
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  u32 done;
  do {
    asm volatile("{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
                 "selp.u32 %0, 1, 0, p;\n\t}" : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  } while (!done);
}

// ``bytes`` (a multiple of 16; 16-byte aligned addresses) from global memory into this CTA's
// shared memory, completing on ``bar``.
__device__ __forceinline__ void bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, "
               "[%3];" :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// Box (c0, c1) of a 2-D tensor map (its innermost coordinate first; a ``const
// __grid_constant__`` kernel parameter, passed by generic address) into this CTA's shared
// memory, laid out and swizzled as the map says, completing on ``bar``. Elements outside the
// tensor arrive as zeros (and count toward the expected bytes).
__device__ __forceinline__ void bulk_tensor_2d(u32 dst, const void* map, int c0, int c1,
                                               u32 bar) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes "
               "[%0], [%1, {%2, %3}], [%4];" :: "r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(bar)
               : "memory");
}

// Makes this thread's mbarrier initializations visible to the async proxy (bulk copies
// completing on them); a CTA barrier then publishes them to the other threads.
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// --- programmatic dependent launch (sm_90+) ---
// A kernel launched with the programmatic-serialization attribute (Kernel.launch(...,
// programmatic=True)) may start while the kernel before it on the stream still runs: it must
// wait here before it reads anything that kernel may write, or writes anything it may read.
// Without the attribute, and before sm_90, both are no-ops.

__device__ __forceinline__ void grid_dependency_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the next programmatic launch on the stream start its CTAs (once every CTA of this grid
// has called it or exited); they still wait for this grid to finish in grid_dependency_wait.
__device__ __forceinline__ void grid_dependents_launch() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// --- shared-memory loads and stores ---

__device__ __forceinline__ u32 lds32(u32 addr) {
  u32 v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr));
  return v;
}

__device__ __forceinline__ uint2 lds64(u32 addr) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(addr));
  return v;
}

__device__ __forceinline__ uint4 lds128(u32 addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}

// The same loads as floats (bit casts: no instruction).
__device__ __forceinline__ float2 lds64f(u32 addr) {
  const uint2 v = lds64(addr);
  return make_float2(__uint_as_float(v.x), __uint_as_float(v.y));
}

__device__ __forceinline__ float4 lds128f(u32 addr) {
  const uint4 v = lds128(addr);
  return make_float4(__uint_as_float(v.x), __uint_as_float(v.y), __uint_as_float(v.z),
                     __uint_as_float(v.w));
}

__device__ __forceinline__ void sts32(u32 addr, u32 v) {
  asm volatile("st.shared.u32 [%0], %1;" :: "r"(addr), "r"(v) : "memory");
}

__device__ __forceinline__ void sts128(u32 addr, u32 a, u32 b, u32 c, u32 d) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" :: "r"(addr), "r"(a), "r"(b), "r"(c),
               "r"(d));
}

__device__ __forceinline__ void sts64f(u32 addr, float a, float b) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};" :: "r"(addr), "f"(a), "f"(b));
}

__device__ __forceinline__ void sts128f(u32 addr, float a, float b, float c, float d) {
  asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" :: "r"(addr), "f"(a), "f"(b), "f"(c),
               "f"(d));
}
