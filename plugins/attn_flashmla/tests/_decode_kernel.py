"""A test kernel around the decode kernel's E8M0 tile decode (``_e8m0_words``), so that a
GPU test can check it value by value against torch (imports triton: load it lazily)."""

from __future__ import annotations

import triton
import triton.language as tl
from kernelbay_attn_flashmla import triton_kernels as tk


@triton.jit
def e8m0_words_kernel(words_ptr, raw_ptr, out_ptr, BLOCK_N: tl.constexpr,
                      C_PAD: tl.constexpr, GROUP: tl.constexpr, FAST_FP8: tl.constexpr):
    """out[BLOCK_N, C_PAD] = the decode of words [BLOCK_N, C_PAD // 4] (int32, four codes
    each) with E8M0 bytes raw [BLOCK_N, C_PAD // GROUP], as the decode kernel does it."""
    NG: tl.constexpr = C_PAD // GROUP
    rows = tl.arange(0, BLOCK_N)
    word = (tl.arange(0, NG)[None, :, None] * (GROUP // 4)
            + tl.arange(0, GROUP // 4)[None, None, :])
    words = tl.load(words_ptr + rows[:, None, None] * (C_PAD // 4) + word)
    raw = tl.load(raw_ptr + rows[:, None] * NG + tl.arange(0, NG)[None, :])
    values = tk._e8m0_words(words, raw, BLOCK_N, C_PAD, GROUP, FAST_FP8)
    cols = tl.arange(0, C_PAD)
    tl.store(out_ptr + rows[:, None] * C_PAD + cols[None, :], values.to(tl.float32))
