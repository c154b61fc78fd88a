# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# (Triton kernels are written in its untyped DSL; the Python wrappers are typed.)
"""Triton kernels of the batch-invariant mode: matmul and paged attention.

Each kernel fixes the order of every sum by compile-time constants that depend on the
problem's N / K / head sizes only; a row of the output is computed by one program (or by
one column of programs) the same way whatever else is in the batch.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernelbay_batch_invariant.configs import MatmulConfig

__all__ = ["invariant_matmul", "paged_attention", "runs_whole", "split_ranges",
           "token_positions"]


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"


@triton.jit
def _k_walk(x_ptr, w_ptr, m0, n0, offs_m, offs_n, M, N, K, t_lo, t_hi, TILES_PER_SPLIT,
            stride_xm, stride_xk, stride_wn, stride_wk, part_ptrs, part_stride, part_mask,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            IEEE: tl.constexpr, USE_DOT: tl.constexpr, EVEN_K: tl.constexpr,
            MANY: tl.constexpr, TMA: tl.constexpr, STORE_EACH: tl.constexpr):
    # One loop over the K tiles [t_lo, t_hi) (BLOCK_K wide). Every split-K slice
    # (TILES_PER_SPLIT tiles, starting at a multiple of it) is summed from zero into `acc`
    # and, at its last tile, added to `total`: (((slice 0) + slice 1) + ..). A range of one
    # slice gives that slice's partial; the whole of K gives the tile's sum with the same
    # arithmetic, in one software-pipelined loop (no restart of the pipeline per slice).
    # MANY: the range may hold several slices (else it is one slice, or all of K unsplit,
    # and `acc` alone is the result: one accumulator's registers, not two). STORE_EACH: the
    # range holds several slices and each one's partial is stored on its own (at
    # part_ptrs + slice * part_stride) for a later sum in slice order; nothing is returned.
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # -0.0 + p == p for every p (also p = -0.0): the first slice lands unchanged.
    total = tl.full((BLOCK_M, BLOCK_N), -0.0, dtype=tl.float32)
    for t in range(t_lo, t_hi):
        kk = t * BLOCK_K + offs_k
        if TMA:
            # Tensor-memory-accelerator loads (x_ptr / w_ptr are tensor descriptors): rows
            # and K past the end read as zeros, the values the masked loads give.
            a = x_ptr.load([m0, t * BLOCK_K])
            b = w_ptr.load([n0, t * BLOCK_K]).T
        elif EVEN_K:  # K is whole BLOCK_K tiles: no K mask (same values loaded)
            a = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :] * stride_xk,
                        mask=offs_m[:, None] < M, other=0.0)
            b = tl.load(w_ptr + kk[:, None] * stride_wk + offs_n[None, :] * stride_wn,
                        mask=offs_n[None, :] < N, other=0.0)
        else:
            a = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :] * stride_xk,
                        mask=(offs_m[:, None] < M) & (kk[None, :] < K), other=0.0)
            b = tl.load(w_ptr + kk[:, None] * stride_wk + offs_n[None, :] * stride_wn,
                        mask=(kk[:, None] < K) & (offs_n[None, :] < N), other=0.0)
        if not USE_DOT:
            # Triton's CPU interpreter runs tl.dot as a BLAS call whose result for a row can
            # follow the row's place in the tile; an explicit product and sum cannot.
            acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
        elif IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        if MANY:  # noqa: SIM102 (a constexpr test apart: no branch compiled without it)
            if ((t + 1) % TILES_PER_SPLIT == 0) | (t == t_hi - 1):
                total += acc
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if STORE_EACH:  # noqa: SIM102 (a constexpr test apart: no branch compiled without it)
            if ((t + 1) % TILES_PER_SPLIT == 0) | (t == t_hi - 1):
                tl.store(part_ptrs + (t // TILES_PER_SPLIT) * part_stride, acc,
                         mask=part_mask)
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if not MANY:
        total = acc
    return total


@triton.jit
def _matmul_kernel(x_ptr, w_ptr, y_ptr, ws_ptr, lock_ptr, M, N, K, K_PER_SPLIT,
                   stride_xm, stride_xk, stride_wn, stride_wk, stride_ys, stride_ym, stride_yn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, IEEE: tl.constexpr, USE_DOT: tl.constexpr,
                   EVEN_K: tl.constexpr, SPLITS: tl.constexpr, WHOLE_TILE: tl.constexpr,
                   SUM_IN_KERNEL: tl.constexpr, TMA: tl.constexpr, GROUP: tl.constexpr):
    # Slice s of K is [s * K_PER_SPLIT, (s + 1) * K_PER_SPLIT), fixed by K and the config,
    # never by M; an element is (((slice 0) + slice 1) + ..), each slice summed from zero.
    # WHOLE_TILE: this program sums every slice of its tile in that order. Otherwise one
    # program per (tile, slice), the slice varying fastest so a tile's slices run side by
    # side, and the partials are added in the same order afterwards. Same arithmetic, same
    # bits: which one runs may follow M (it is chosen from the number of tiles).
    # GROUP > 1 (not whole tiles): each program walks GROUP consecutive slices in one loop
    # and stores each slice's partial apart (SPLITS // GROUP programs per tile); the sum
    # afterwards is the same. `split` is then the program's first slice.
    parts = SPLITS // GROUP
    if WHOLE_TILE:
        pid = tl.program_id(0)
        split = 0
    else:
        pid = tl.program_id(0) // parts
        split = (tl.program_id(0) % parts) * GROUP
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Grouped launch order (L2 reuse of W tiles): it moves tiles between programs only.
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_size
    pid_n = (pid % in_group) // group_size
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    per = tl.maximum(K_PER_SPLIT // BLOCK_K, 1)  # K = 0: no tiles, no slices to size
    if WHOLE_TILE:
        t_lo = 0
        t_hi = k_tiles
        # Trailing empty slices add a +0.0 partial each in the other sums: the same here.
        short = tl.cdiv(k_tiles, per) < SPLITS
    else:
        t_lo = tl.minimum(split * per, k_tiles)
        t_hi = tl.minimum(t_lo + per * GROUP, k_tiles)
        short = t_lo >= t_hi  # an empty slice's partial is +0.0
    y_ptrs = y_ptr + split * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
    y_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tile = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    slot = BLOCK_M * BLOCK_N
    tiles = tl.num_programs(0) // parts
    # Where GROUP > 1 stores slice s's partial: ws_ptr + (s * tiles + pid) * slot (in-kernel
    # sum) or y_ptr + s * stride_ys (second kernel), as one program per slice would.
    if SUM_IN_KERNEL:
        part_ptrs = ws_ptr + pid * slot + tile
        part_stride = tiles * slot
        part_mask = tile >= 0
    else:
        part_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
        part_stride = stride_ys
        part_mask = y_mask
    acc = _k_walk(x_ptr, w_ptr, pid_m * BLOCK_M, pid_n * BLOCK_N, offs_m, offs_n, M, N, K,
                  t_lo, t_hi, per, stride_xm, stride_xk, stride_wn, stride_wk, part_ptrs,
                  part_stride, part_mask, BLOCK_M, BLOCK_N, BLOCK_K, IEEE, USE_DOT, EVEN_K,
                  WHOLE_TILE and SPLITS > 1, TMA, GROUP > 1 and not WHOLE_TILE)
    if GROUP > 1 and not WHOLE_TILE:
        # Slices of this program past the end of K were not walked: their partial is +0.0.
        for g in tl.static_range(GROUP):
            if (split + g) * per >= k_tiles:
                tl.store(part_ptrs + (split + g) * part_stride,
                         tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), mask=part_mask)
    elif SPLITS > 1:  # noqa: SIM102 (a constexpr test apart: no branch compiled without it)
        if short:
            acc += 0.0
    if SUM_IN_KERNEL and not WHOLE_TILE:
        # Each slice parks its partial tile in a tile-major workspace; the program that
        # arrives last (counted per tile) adds all SPLITS partials in slice order 0, 1, ..
        # and writes the output. Which program sums depends on timing, the order does not.
        if GROUP == 1:
            tl.store(ws_ptr + (split * tiles + pid) * slot + tile, acc)
        tl.debug_barrier()  # every thread's partial is written before the release below
        arrived = tl.atomic_add(lock_ptr + pid, 1, sem="acq_rel")
        if arrived == parts - 1:
            tl.debug_barrier()
            # .cg: read the peers' partials from L2, never from a stale L1 line.
            total = tl.load(ws_ptr + pid * slot + tile, cache_modifier=".cg")
            for s in tl.static_range(1, SPLITS):
                total += tl.load(ws_ptr + (s * tiles + pid) * slot + tile,
                                 cache_modifier=".cg")
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=y_mask)
            tl.atomic_xchg(lock_ptr + pid, 0)  # ready for the next launch
    elif WHOLE_TILE or GROUP == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)


@triton.jit
def _split_sum_kernel(part_ptr, y_ptr, numel, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    # Partials [SPLITS, numel] (fp32) summed in slice order 0, 1, .., SPLITS - 1 for every
    # element: the order is a constant, not the order in which the slices finished.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(part_ptr + s * numel + offs, mask=mask, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


_LOCKS: dict[torch.device, torch.Tensor] = {}
_SMS: dict[torch.device, int] = {}


def _programs_to_fill(device: torch.device) -> int:
    """Output tiles from which one program per tile already fills the device: its SM count
    (CUDA), else 1 (the interpreter: every split runs as whole tiles unless forced)."""
    if device.type != "cuda":
        return 1
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]


def _tile_locks(device: torch.device, tiles: int) -> torch.Tensor:
    """Per-tile arrival counters of the in-kernel split-K sum, zero between launches (the
    last program of a tile resets its counter). One set per device: launches on one stream
    are ordered; concurrent launches on several streams would share them."""
    locks = _LOCKS.get(device)
    if locks is None or locks.numel() < tiles:
        locks = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
        _LOCKS[device] = locks
    return locks


def runs_whole(config: MatmulConfig, tiles: int, sms: int) -> bool:
    """Whether ``tiles`` output tiles of ``config`` run as whole tiles (one program summing
    every slice of its tile) on a device of ``sms`` SMs: always without a split, else from
    ``config.whole_from * sms`` tiles up. Either way the bits are the same."""
    return config.split_k == 1 or tiles >= config.whole_from * sms


def split_ranges(k: int, config: MatmulConfig) -> list[tuple[int, int]]:
    """The ``[lo, hi)`` K ranges of ``config``'s split-K slices for reduction length ``k``
    (a function of K and the config only; trailing slices may be empty)."""
    per = _k_per_split(k, config)
    return [(min(s * per, k), min((s + 1) * per, k)) for s in range(config.split_k)]


def _k_per_split(k: int, config: MatmulConfig) -> int:
    # Whole BLOCK_K tiles per slice, so a slice's tiles are the unsplit walk's tiles.
    tiles = -(-k // config.block_k)
    return -(-tiles // config.split_k) * config.block_k


def _descriptors(x: torch.Tensor, weight: torch.Tensor, config: MatmulConfig
                 ) -> tuple[object, object]:
    """Tensor descriptors of ``x`` [M, K] and ``weight`` [N, K] with the config's tile
    boxes. A row stride that is not a multiple of 16 bytes cannot be described: the config
    is refused (a function of K, so never of M). A misaligned or strided ``x`` is copied to a
    fresh (aligned) tensor: the kernel stays the same whatever the input's address."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    k = x.shape[1]
    if (k * x.element_size()) % 16:
        raise ValueError(f"invariant_matmul: config.tma needs K * itemsize to be a multiple "
                         f"of 16 bytes; K is {k} for {x.dtype}")

    def fit(t: torch.Tensor) -> torch.Tensor:
        if t.stride(1) != 1 or t.stride(0) != k or t.data_ptr() % 16:
            t = torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t)
        return t

    x, weight = fit(x), fit(weight)
    return (TensorDescriptor(x, list(x.shape), list(x.stride()),
                             [config.block_m, config.block_k]),
            TensorDescriptor(weight, list(weight.shape), list(weight.stride()),
                             [config.block_n, config.block_k]))


def _slices_per_program(tiles: int, splits: int, programs: int) -> int:
    """How many consecutive slices one program walks when the slices run on separate
    programs: the most (a divisor of ``splits``) that still leaves at least ``programs``
    programs, else 1. Fewer, longer programs where one per slice would be far more than
    the device runs at once."""
    group = 1
    for g in range(2, splits + 1):
        if splits % g == 0 and tiles * (splits // g) >= programs:
            group = g
    return group


def invariant_matmul(x: torch.Tensor, weight: torch.Tensor, config: MatmulConfig,
                     *, whole_tiles: bool | None = None,
                     slices_per_program: int | None = None) -> torch.Tensor:
    """``x [M, K] @ weight[N, K]^T`` with ``config``'s tiling (chosen from N, K, dtype).

    With ``config.split_k > 1`` each output tile's K range is cut into ``split_k`` fixed
    slices (``split_ranges``) whose fp32 partial sums go to a workspace and are added in
    slice order, by a second kernel or (``config.sum_in_kernel``) by the tile's last
    program to finish; the slices and that order depend on K and the config only, so a row's
    result still does not depend on M.

    Who sums the slices may follow M, because the arithmetic does not change: with at
    least ``config.whole_from`` times as many output tiles as the device has SMs
    (``whole_tiles``, by default) one
    program sums all slices of its tile in slice order, with no workspace; with fewer, one
    program per (tile, slice) gives the device enough programs. ``whole_tiles`` forces
    either (tests compare their bits). Between the two, a program may walk several
    consecutive slices (``_slices_per_program``, or forced by ``slices_per_program``, a
    divisor of ``split_k``) and store each one's partial apart: the sum is the same.

    ``config.tma`` loads the tiles through tensor descriptors (``_descriptors``) instead of
    pointers; the values and the K walk are the same. ``config.whole_tma`` and
    ``config.whole_stages`` do so / set the pipeline depth only when the tiles run whole
    (``config.lone_stages`` when they are at most one per SM).
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"invariant_matmul: wants x [M, K] and weight [N, K], got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype != weight.dtype:
        raise ValueError(f"invariant_matmul: x is {x.dtype}, weight is {weight.dtype}; they "
                         "must match")
    if config.split_k < 1:
        raise ValueError(f"invariant_matmul: config.split_k is {config.split_k}; valid: an "
                         "integer >= 1")
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    splits = config.split_k
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    if whole_tiles is None:
        whole_tiles = runs_whole(config, tiles, _programs_to_fill(x.device))
    whole_tiles = whole_tiles or splits == 1
    in_kernel = not whole_tiles and config.sum_in_kernel
    if slices_per_program is None:  # CUDA only: the interpreter's split tests force it
        group = 1 if whole_tiles or x.device.type != "cuda" else _slices_per_program(
            tiles, splits, _programs_to_fill(x.device))
    elif slices_per_program < 1 or splits % slices_per_program:
        raise ValueError(f"invariant_matmul: slices_per_program is {slices_per_program}; "
                         f"valid: a divisor of config.split_k = {splits}")
    else:
        group = 1 if whole_tiles else slices_per_program
    # Slices on separate programs summed by a second kernel write fp32 partials
    # [splits, M, N]; otherwise the kernel writes the output (the in-kernel sum parks
    # partials in a tile workspace first).
    out = y if whole_tiles or in_kernel else torch.empty((splits, m, n), dtype=torch.float32,
                                                         device=x.device)
    stride_s = 0 if out is y else out.stride(0)
    ws, locks = y, y
    if in_kernel:
        ws = torch.empty(splits * tiles * config.block_m * config.block_n,
                         dtype=torch.float32, device=x.device)
        locks = _tile_locks(x.device, tiles)
    grid = (tiles if whole_tiles else tiles * (splits // group),)
    if config.whole_tma and (k * x.element_size()) % 16:  # refused at every M, not only large
        raise ValueError(f"invariant_matmul: config.whole_tma needs K * itemsize to be a "
                         f"multiple of 16 bytes; K is {k} for {x.dtype}")
    # K = 0 loads nothing: no descriptor of an empty extent.
    tma = (config.tma or (whole_tiles and config.whole_tma)) and k > 0
    stages = config.whole_stages if whole_tiles and config.whole_stages else config.num_stages
    if whole_tiles and config.lone_stages and tiles <= _programs_to_fill(x.device):
        stages = config.lone_stages
    xa, wa = _descriptors(x, weight, config) if tma else (x, weight)
    _matmul_kernel[grid](xa, wa, out, ws, locks, m, n, k, _k_per_split(k, config),
                         x.stride(0), x.stride(1), weight.stride(0),
                         weight.stride(1), stride_s, out.stride(-2), out.stride(-1),
                         BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                         BLOCK_K=config.block_k, GROUP_M=config.group_m,
                         IEEE=x.dtype == torch.float32, USE_DOT=not _interpreting(),
                         EVEN_K=k % config.block_k == 0, SPLITS=splits,
                         WHOLE_TILE=whole_tiles, SUM_IN_KERNEL=in_kernel, TMA=tma,
                         GROUP=group,
                         num_warps=config.num_warps, num_stages=stages)
    if out is not y:
        numel = m * n
        block = 1024
        _split_sum_kernel[(triton.cdiv(numel, block),)](out, y, numel, SPLITS=splits,
                                                        BLOCK=block, num_warps=4)
    return y


@triton.jit
def _attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, tables_ptr, seq_ptr, visible_ptr,
                      scale, window,
                      sq_t, sq_h, sk_p, sk_s, sk_h, sv_p, sv_s, sv_h, so_t, so_h, st_b,
                      GROUP: tl.constexpr, D_K: tl.constexpr, D_V: tl.constexpr,
                      BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
                      PAGE: tl.constexpr, HAS_WINDOW: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    b = tl.load(seq_ptr + t)
    visible = tl.load(visible_ptr + t)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(visible - window, 0)
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + t * sq_t + h * sq_h + dk, mask=dk < D_K, other=0.0).to(tl.float32)
    # Running max and sum as fp32 scalar tensors (a Python float would change type in the loop).
    m_i = tl.max(tl.full((BLOCK_N,), float("-inf"), tl.float32), axis=0)
    l_i = tl.sum(tl.zeros((BLOCK_N,), dtype=tl.float32), axis=0)
    acc = tl.zeros((BLOCK_DV,), dtype=tl.float32)
    # Key chunks are aligned to absolute positions (fixed split size BLOCK_N): a token's
    # chunks are the same whether it is decoded alone, in a batch or verified with drafts.
    for start in range((lo // BLOCK_N) * BLOCK_N, visible, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = (pos < visible) & (pos >= lo)
        page = tl.load(tables_ptr + b * st_b + pos // PAGE, mask=valid, other=0).to(tl.int64)
        slot = pos % PAGE
        k = tl.load(k_ptr + page[:, None] * sk_p + slot[:, None] * sk_s + kvh * sk_h
                    + dk[None, :], mask=valid[:, None] & (dk[None, :] < D_K),
                    other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], axis=1) * scale
        s = tl.where(valid, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        p = tl.exp(s - m_new)
        alpha = tl.exp(m_i - m_new)
        v = tl.load(v_ptr + page[:, None] * sv_p + slot[:, None] * sv_s + kvh * sv_h
                    + dv[None, :], mask=valid[:, None] & (dv[None, :] < D_V),
                    other=0.0).to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
    out = acc / l_i
    tl.store(o_ptr + t * so_t + h * so_h + dv, out.to(o_ptr.dtype.element_ty), mask=dv < D_V)


def token_positions(query_start_loc: torch.Tensor, seq_lens: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sequence index [T], visible keys [T])`` of every new token: token ``j`` of the
    ``n`` new tokens of a sequence of length ``L`` sees ``L - n + j + 1`` keys."""
    starts = query_start_loc.long()
    total = int(starts[-1])
    idx = torch.arange(total, device=starts.device)
    seq = torch.searchsorted(starts[1:], idx, right=True)
    visible = seq_lens.long()[seq] - (starts[seq + 1] - idx) + 1
    return seq.to(torch.int32), visible.to(torch.int32)


def paged_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    block_tables: torch.Tensor, seq: torch.Tensor, visible: torch.Tensor,
                    scale: float, value_dim: int, page_size: int,
                    sliding_window: int | None = None, block_n: int = 64) -> torch.Tensor:
    """Causal paged attention, one program per (new token, query head).

    ``query`` [T, H, Dk]; ``keys`` / ``values`` [pages, page_size, kv_heads, D] views of the
    cache (last dim contiguous; values may be a prefix of the keys' last dim, as MLA's);
    ``seq`` / ``visible`` from ``token_positions``. Returns [T, H, value_dim].
    """
    tokens, heads, d_k = query.shape
    kv_heads = keys.shape[2]
    out = torch.empty((tokens, heads, value_dim), dtype=query.dtype, device=query.device)
    if tokens == 0:
        return out
    query = query.contiguous()
    grid = (tokens, heads)
    _attention_kernel[grid](
        query, keys, values, out, block_tables, seq, visible, float(scale),
        int(sliding_window or 0),
        query.stride(0), query.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2), out.stride(0), out.stride(1),
        block_tables.stride(0),
        GROUP=heads // kv_heads, D_K=d_k, D_V=value_dim,
        BLOCK_DK=triton.next_power_of_2(d_k), BLOCK_DV=triton.next_power_of_2(value_dim),
        BLOCK_N=block_n, PAGE=page_size, HAS_WINDOW=sliding_window is not None)
    return out
