// NVFP4 fragment-word decode shared by the CUDA kernels of this plugin (the host puts this text
// in front of each kernel's source before NVRTC compiles it: cuda_gemv._source).
//
// A fragment-order word (linear_triton.layout_tensors) holds eight E2M1 codes; register r
// (0..3) of the word is elements 2r and 2r + 1 of its order as two bf16 lanes reading
// e2m1 * 2^-126 (sign at bit 15, e1 e0 m at bits 8..6), and one fma.rn.bf16x2 by a block's
// multiplier pair (scale code * 0x100010 + 0x76007600, scale_codes.py) makes e2m1 * S * 2^-8,
// exact in bf16.

#pragma once

#include "kernelbay/ptx.cuh"  // u32

// Two lanes times their multiplier pair, plus -0 (zero products keep their sign).
__device__ __forceinline__ u32 scaled(u32 lanes, u32 mult) {
  u32 out;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(out) : "r"(lanes), "r"(mult), "r"(0x80008000u));
  return out;
}

// Register r (0..3) of a word: elements 2r and 2r + 1 as bf16 e2m1 * 2^-126.
__device__ __forceinline__ u32 lanes_of(u32 u, int r) {
  const u32 keep = 0x81C081C0u;
  if (r == 0) return u & keep;
  if (r == 1) return (u << 3) & keep;
  if (r == 2) return (u << 6) & keep;
  return ((u << 1) & 0x80008000u) | ((u >> 4) & 0x00C000C0u) | ((u >> 5) & 0x01000100u);
}

// The bf16 multiplier pair of a scale code (its low byte).
__device__ __forceinline__ u32 multiplier(u32 code) {
  return (code & 0xFFu) * 0x100010u + 0x76007600u;
}
