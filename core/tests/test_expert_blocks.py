"""The routing grouped by expert for grouped-GEMM MoE kernels (``kernelbay.layers.expert_blocks``),
checked against the routing read on the host, and made without a host read."""

from __future__ import annotations

import pytest
import torch
from kernelbay.layers.expert_blocks import expert_blocks, max_blocks
from kernelbay.testing.capture import simulated_capture


def _check(ids: torch.Tensor, experts: int, block_m: int) -> None:
    blocks = expert_blocks(ids, experts, block_m)
    flat = ids.reshape(-1).tolist()
    n = len(flat)
    slots = blocks.slots.tolist()
    owner = blocks.experts.tolist()
    assert blocks.num_slots == n and blocks.top_k == ids.shape[1] and blocks.block_m == block_m
    assert blocks.max_blocks == max_blocks(n, experts, block_m) == len(owner)
    assert len(slots) == len(owner) * block_m
    assert blocks.slots.dtype == blocks.experts.dtype == torch.int32
    # every slot exactly once, the rest padding
    assert sorted(s for s in slots if s != n) == list(range(n))
    assert all(0 <= s <= n for s in slots)
    counts = {e: flat.count(e) for e in range(experts)}
    used = sum(-(-c // block_m) for c in counts.values())
    # the used blocks first, then -1 only
    assert all(e >= 0 for e in owner[:used]) and all(e == -1 for e in owner[used:])
    seen: dict[int, list[int]] = {}
    for b, e in enumerate(owner[:used]):
        rows = [s for s in slots[b * block_m:(b + 1) * block_m] if s != n]
        assert rows, f"block {b} of expert {e} is empty"
        assert all(flat[s] == e for s in rows), (b, e, rows)
        seen.setdefault(e, []).extend(rows)
    assert list(seen) == sorted(seen), "blocks are not in expert order"
    for e, rows in seen.items():
        assert rows == sorted(rows) and len(rows) == counts[e]
        # padding only at the end of an expert's last block
        assert -(-len(rows) // block_m) == owner[:used].count(e)


@pytest.mark.parametrize("tokens, top_k, experts, block_m", [
    (1, 1, 1, 16), (1, 8, 256, 16), (7, 2, 3, 16), (40, 2, 8, 16), (33, 4, 5, 4),
    (300, 8, 16, 64), (5, 3, 40, 1), (64, 2, 2, 32),
])
def test_blocks_cover_each_slot_once_in_expert_blocks(tokens: int, top_k: int, experts: int,
                                                      block_m: int) -> None:
    gen = torch.Generator().manual_seed(tokens * 31 + experts)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] if top_k <= experts
                       else torch.randint(0, experts, (top_k,), generator=gen)
                       for _ in range(tokens)])
    _check(ids, experts, block_m)


def test_skewed_and_repeated_routing() -> None:
    """One expert takes almost everything (many full blocks), others none; a token may name an
    expert twice (the slots stay distinct)."""
    ids = torch.zeros(50, 2, dtype=torch.long)
    ids[::7, 1] = 3
    _check(ids, 4, 8)
    _check(torch.tensor([[2, 2], [2, 0]]), 3, 2)


def test_no_tokens() -> None:
    blocks = expert_blocks(torch.zeros(0, 4, dtype=torch.long), 8, 16)
    assert blocks.max_blocks == 0 and blocks.slots.numel() == 0 and blocks.num_slots == 0


def test_bad_arguments_name_what_was_expected() -> None:
    with pytest.raises(ValueError, match=r"\[tokens, top_k\].*\(6,\)"):
        expert_blocks(torch.zeros(6, dtype=torch.long), 4, 16)
    with pytest.raises(ValueError, match="block_m=0"):
        expert_blocks(torch.zeros(2, 2, dtype=torch.long), 4, 0)


def test_made_without_reading_the_routing_on_the_host() -> None:
    ids = torch.tensor([[3, 1], [1, 0], [3, 2]])
    want = expert_blocks(ids, 4, 2)
    with simulated_capture():
        got = expert_blocks(ids, 4, 2)
    assert torch.equal(got.slots, want.slots) and torch.equal(got.experts, want.experts)


_TRITON_CASES = """
import torch
from kernelbay.layers.expert_blocks import expert_blocks, max_blocks
from kernelbay.layers.expert_blocks_triton import SMALL_SLOTS, fill_expert_blocks


def run(ids, experts, block_m, program, **knobs):
    blocks = max_blocks(ids.numel(), experts, block_m)
    slots = torch.empty(blocks * block_m, dtype=torch.int32, device=ids.device)
    owners = torch.empty(blocks, dtype=torch.int32, device=ids.device)
    fill_expert_blocks(ids, experts, block_m, slots, owners, program=program, **knobs)
    return slots, owners


def programs(n):
    # every program that takes n slots, the multi-program one with several chunk sizes (16:
    # many programs, the last one part-full)
    return ([("small", {})] if n <= SMALL_SLOTS else []) \
        + [("multi", {"chunk": c}) for c in (16, 64, 128)]


cases = [(1, 1, 1, 16), (1, 8, 256, 16), (7, 2, 3, 16), (40, 2, 8, 16), (33, 4, 5, 4),
         (32, 8, 256, 16), (30, 8, 16, 64), (5, 3, 40, 1), (64, 2, 2, 32), (0, 2, 4, 16),
         (85, 3, 300, 8), (8, 8, 256, 16), (32, 2, 3, 16), (70, 8, 256, 16), (150, 4, 9, 32)]
gen = torch.Generator().manual_seed(0)
for tokens, top_k, experts, block_m in cases:
    for skew in (False, True):
        ids = torch.randint(0, experts, (tokens, top_k), generator=gen)
        if skew:
            ids[::3] = experts - 1
        want = expert_blocks(ids, experts, block_m, kernel="torch")
        got = expert_blocks(ids.int(), experts, block_m, kernel="triton")
        assert torch.equal(got.slots, want.slots), (tokens, top_k, experts, block_m, skew)
        assert torch.equal(got.experts, want.experts), (tokens, top_k, experts, block_m, skew)
        for program, knobs in programs(ids.numel()):
            slots, owners = run(ids, experts, block_m, program, **knobs)
            assert torch.equal(slots, want.slots), (program, knobs, tokens, top_k, experts, skew)
            assert torch.equal(owners, want.experts), (program, knobs, tokens, top_k, experts,
                                                       skew)
# unsigned ids: the same blocks (160 slots: the multi-program routing; 56: the one-tile one)
for shape in ((20, 8), (7, 8)):
    ids = torch.randint(0, 200, shape, generator=gen)
    want = expert_blocks(ids, 256, 16, kernel="torch")
    got = expert_blocks(ids.to(torch.uint8), 256, 16, kernel="triton")
    assert torch.equal(got.slots, want.slots) and torch.equal(got.experts, want.experts)
# ids outside [0, E): those slots join no block, the others are grouped as usual
ids = torch.randint(0, 5, (30, 3), generator=gen)
ids[::4, 0] = 9
ids[1, 1] = -2
ids[2, 2] = 2**32 + 1  # would wrap to expert 1 if narrowed before the range check
ids[3, 0] = -2**32 + 3
got = expert_blocks(ids, 5, 4, kernel="triton")
flat = ids.reshape(-1).tolist()
valid = [s for s, e in enumerate(flat) if 0 <= e < 5]
slots = got.slots.tolist()
assert sorted(s for s in slots if s != len(flat)) == valid, slots
for b, e in enumerate(got.experts.tolist()):
    rows = [s for s in slots[b * 4:(b + 1) * 4] if s != len(flat)]
    assert (e == -1) == (not rows) and all(flat[s] == e for s in rows), (b, e, rows)
# the same with each program
ids = torch.randint(0, 5, (12, 3), generator=gen)
ids[::4, 0] = 9
ids[1, 1] = -2
ids[2, 2] = 2**32 + 1
flat = ids.reshape(-1).tolist()
for program, knobs in programs(ids.numel()):
    slots, owners = run(ids, 5, 4, program, **knobs)
    valid = [s for s, e in enumerate(flat) if 0 <= e < 5]
    assert sorted(s for s in slots.tolist() if s != len(flat)) == valid, (program, slots)
    for b, e in enumerate(owners.tolist()):
        rows = [s for s in slots.tolist()[b * 4:(b + 1) * 4] if s != len(flat)]
        assert (e == -1) == (not rows) and all(flat[s] == e for s in rows), (program, b, e)
for bad, msg in (({"program": "fast"},
                  "program='fast'; valid: ('auto', 'multi', 'small')"),
                 ({"program": "small"}, "65 routed slots, the one-tile program takes at most "
                                        "SMALL_SLOTS=64"),
                 ({"program": "multi", "chunk": 48},
                  "chunk=48; valid: (16, 32, 64, 128, 256)"),
                 ({"program": "multi", "chunk": 512},
                  "chunk=512; valid: (16, 32, 64, 128, 256)")):
    ids = torch.zeros(13, 5, dtype=torch.int32)
    try:
        run(ids, 4, 16, **bad)
    except ValueError as exc:
        assert msg in str(exc), exc
    else:
        raise AssertionError(f"{bad} must be refused")
print("ok", len(cases))
"""


def test_the_triton_program_makes_the_same_blocks() -> None:
    """Every Triton program == the tensor operations, bit for bit, in Triton's
    interpreter (a child process: the interpreter is chosen when ``triton.jit`` decorates)."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys

    from kernelbay.testing.interpreter import triton_interpreter_problem

    problem = triton_interpreter_problem()
    if problem:
        pytest.skip(problem)
    proc = subprocess.run([sys.executable, "-c", _TRITON_CASES],
                          env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr[-3000:]


def test_an_unknown_kernel_is_named() -> None:
    with pytest.raises(ValueError, match=r"kernel='cuda'.*'auto', 'torch', 'triton'"):
        expert_blocks(torch.zeros(2, 2, dtype=torch.long), 4, 16, kernel="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens, top_k, experts, block_m", [
    (1, 8, 256, 16), (16, 8, 256, 16), (32, 8, 256, 16), (20, 8, 300, 64), (100, 2, 8, 32),
    (7, 3, 5, 16), (1000, 8, 256, 16), (513, 6, 64, 64)])
def test_cuda_triton_blocks_equal_the_tensor_operations(tokens: int, top_k: int, experts: int,
                                                        block_m: int) -> None:
    """Every Triton program on the GPU (300 experts, 64-row blocks, up to 8000 slots: the
    multi-program routing with 63 chunks, the last part-full) against the tensor operations;
    ``auto`` takes them there."""
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k]
                       for _ in range(tokens)]).cuda()
    want = expert_blocks(ids, experts, block_m, kernel="torch")
    for kernel in ("triton", "auto"):
        got = expert_blocks(ids, experts, block_m, kernel=kernel)
        assert torch.equal(got.slots, want.slots) and torch.equal(got.experts, want.experts)
    from kernelbay.layers.expert_blocks import max_blocks
    from kernelbay.layers.expert_blocks_triton import SMALL_SLOTS, fill_expert_blocks

    blocks = max_blocks(ids.numel(), experts, block_m)
    variants = ([("small", {})] if ids.numel() <= SMALL_SLOTS else []) \
        + [("multi", {"chunk": c}) for c in (16, 128, 256)]
    for program, knobs in variants:
        for warps in (1, 2, 4, 8):
            slots = torch.empty(blocks * block_m, dtype=torch.int32, device="cuda")
            owners = torch.empty(blocks, dtype=torch.int32, device="cuda")
            fill_expert_blocks(ids, experts, block_m, slots, owners, program=program,
                               num_warps=warps, **knobs)
            assert torch.equal(slots, want.slots), (program, knobs, warps)
            assert torch.equal(owners, want.experts), (program, knobs, warps)


@pytest.mark.parametrize("program", ["small", "counts", "bases", "scatter"])
def test_the_triton_program_compiles_for_sm90_with_one_slot(program: str) -> None:
    """Compiled for a CUDA target on the CPU (ptxas, no GPU), with the slot count a
    compile-time 1 as Triton specializes it at one routed slot (the interpreter never does);
    the multi-program routing's three kernels at their default widths; with programmatic
    launches where this Triton has them."""
    pytest.importorskip("triton")
    from kernelbay.layers import expert_blocks_triton as ebt
    from kernelbay.testing.triton_compile import compile_for_cuda

    kernel, values = {
        "small": (ebt.expert_blocks_small_kernel,
                  {"num_slots": 1, "blocks": 1, "BLOCK_M": 16, "SLOTS": 16, "BLOCKS": 16,
                   "CHUNK": 256}),
        "counts": (ebt.chunk_counts_kernel,
                   {"num_slots": 1, "EXPERTS": 256, "CHUNK": 64, "PAD": 256}),
        "bases": (ebt.chunk_bases_kernel,
                  {"chunks": 1, "blocks": 1, "BLOCK_M": 16, "EXPERTS": 256, "ROWS": 16,
                   "LANES": 64}),
        "scatter": (ebt.chunk_scatter_kernel,
                    {"num_slots": 1, "EXPERTS": 256, "CHUNK": 64}),
    }[program]
    from kernelbay.triton_pdl import SUPPORTED

    values["PDL"] = SUPPORTED  # built as CUDA runs them: waiting and releasing
    types = {"ids_ptr": "*i64", "slots_ptr": "*i32", "experts_ptr": "*i32", "counts_ptr": "*i32",
             "bases_ptr": "*i32"}
    compiled = compile_for_cuda(kernel, values, types,
                                num_warps=8 if program == "small" else 4)
    assert "ptx" in compiled.asm


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [4, 64, 1000])
def test_cuda_routing_as_programmatic_dependents(tokens: int, monkeypatch: pytest.MonkeyPatch
                                                 ) -> None:
    """Inside a CUDA graph the multi-program routing's second and third launches depend
    programmatically on the one before (two edges; the one-tile program at 32 slots: none),
    with the bits of plain launches for fresh routings on every replay."""
    from kernelbay.cuda_jit import programmatic_launch
    from kernelbay.testing.programmatic import check_programmatic_chain

    monkeypatch.setenv("KERNELBAY_PDL", "1")
    if not programmatic_launch():
        pytest.skip("programmatic launches need compute capability 9.0 or newer")
    gen = torch.Generator().manual_seed(tokens)
    inputs = [torch.stack([torch.randperm(256, generator=gen)[:8] for _ in range(tokens)]).cuda()
              for _ in range(3)]

    def routing(ids: torch.Tensor) -> torch.Tensor:
        blocks = expert_blocks(ids, 256, 16)
        return torch.cat([blocks.slots, blocks.experts]) + 1  # > 0: the check wants a sum

    check_programmatic_chain(monkeypatch, [routing], inputs, edges=0 if tokens * 8 <= 64 else 2)
    want = expert_blocks(inputs[0], 256, 16, kernel="torch")
    assert torch.equal(routing(inputs[0]) - 1, torch.cat([want.slots, want.experts]))


def test_routings_past_int32_indices_are_refused() -> None:
    """Block rows the programs could not index in int32 are refused on the host, naming the
    sizes, before anything is launched."""
    pytest.importorskip("triton")
    from kernelbay.layers.expert_blocks_triton import fill_expert_blocks

    unused = torch.empty(0, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"1 routed slots in 1 blocks of 2147483648 rows over 4 "
                                         r"experts.*fewer than 2\*\*31"):
        fill_expert_blocks(torch.zeros(1, 1, dtype=torch.int32), 4, 2**31, unused, unused,
                           program="multi")
