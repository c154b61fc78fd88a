"""On a CUDA GPU: bitwise row invariance of the matmul for M = 1..256 at LLM shapes, the
attention kernel's invariance, and the engine's greedy speculative decoding bit-exact with
plain decoding in batch-invariant mode."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (1, 4096)]


def _mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    from kernelbay_batch_invariant.configs import device_shared_memory, matmul_config
    from kernelbay_batch_invariant.kernels import invariant_matmul

    dtype = str(w.dtype).removeprefix("torch.")
    config = matmul_config(w.shape[0], w.shape[1], dtype, device_shared_memory(w.device))
    return invariant_matmul(x, w, config)


@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_bitwise_identical_for_m_1_to_256(n: int, k: int, dtype: torch.dtype) -> None:
    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = torch.randn(n, k, device="cuda", generator=g).to(dtype) * 0.05
    x = torch.randn(256, k, device="cuda", generator=g).to(dtype)
    full = _mm(x, w)
    ref = (x.float() @ w.float().T)
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(full.float(), ref, atol=tol * ref.abs().max().item(), rtol=tol)
    for m in range(1, 257):
        part = _mm(x[:m], w)
        assert torch.equal(part, full[:m]), f"rows differ at M={m} for N={n}, K={k}"
        tail = _mm(x[256 - m:], w)  # the same rows at other places in the tiles
        assert torch.equal(tail, full[256 - m:]), f"rows differ (offset) at M={m}"


@pytest.mark.parametrize("tile", [(64, 128, 4, 4, False), (128, 128, 8, 3, False),
                                  (128, 128, 8, 3, True)])
@pytest.mark.parametrize("split", [2, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_split_k_sums_are_invariant_and_agree(split: int, dtype: torch.dtype,
                                              tile: tuple[int, int, int, int, bool]
                                              ) -> None:
    """Every way of summing the slices (second kernel, the tile's last program, one program
    per whole tile: one K loop adding each slice at its last tile) gives the same bits, also
    for a zero row against all-negative weight rows (products -0.0), and rows do not depend
    on M, also across the tile count at which the default switches from per-slice programs
    to whole tiles. The last tile shape also with tensor-descriptor (TMA) loads; bf16 also
    with descriptor loads for whole tiles only, and programs walking several slices."""
    from dataclasses import replace

    from kernelbay_batch_invariant.configs import MatmulConfig, choose_stages, device_shared_memory
    from kernelbay_batch_invariant.kernels import invariant_matmul

    n, k = 4096, 14336
    itemsize = 2 if dtype == torch.bfloat16 else 4
    block_k = 64 if dtype == torch.bfloat16 else 32
    limit = device_shared_memory(torch.device("cuda"))
    block_m, block_n, warps, stages, tma = tile
    configs = [choose_stages(MatmulConfig(block_m, block_n, block_k, warps, stages,
                                          split_k=split, sum_in_kernel=in_kernel, tma=tma),
                             itemsize, limit)
               for in_kernel in (False, True)]
    g = torch.Generator(device="cuda").manual_seed(split)
    w = torch.randn(n, k, device="cuda", generator=g).to(dtype) * 0.05
    w[:8] = -w[:8].abs()
    x = torch.randn(512, k, device="cuda", generator=g).to(dtype)
    x[5] = 0.0
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    full = invariant_matmul(x, w, configs[0], whole_tiles=True)
    if dtype == torch.bfloat16:  # whole tiles through descriptor loads, 4 stages
        configs.append(replace(configs[1], whole_tma=True, whole_stages=4))
    for config in configs:
        for whole in (False, True, None):
            got = invariant_matmul(x, w, config, whole_tiles=whole)
            assert torch.equal(got.view(bits), full.view(bits)), (config, whole)
        for group in range(2, split + 1):  # programs walking several slices each
            if split % group == 0:
                got = invariant_matmul(x, w, config, whole_tiles=False,
                                       slices_per_program=group)
                assert torch.equal(got.view(bits), full.view(bits)), (config, group)
    ref = x.float() @ w.float().T
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(full.float(), ref, atol=tol * ref.abs().max().item(), rtol=tol)
    for config in configs:
        # 64-row tiles: whole tiles from M = 257; 128-row tiles from M = 513 (not here)
        for m in [*range(1, 257), 300, 400, 511]:
            part = invariant_matmul(x[:m], w, config)
            assert torch.equal(part.view(bits), full[:m].view(bits)), \
                f"rows differ at M={m} ({config})"


def test_shared_memory_probe_and_stage_choice_on_this_device() -> None:
    from kernelbay_batch_invariant.configs import device_shared_memory, matmul_config

    limit = device_shared_memory(torch.device("cuda"))
    assert limit >= 48 * 1024
    config = matmul_config(1, 4096, "float32", limit)
    assert config.num_stages * config.stage_bytes(4) <= limit


def test_paged_attention_invariant_on_gpu() -> None:
    from kernelbay_batch_invariant.kernels import paged_attention, token_positions

    g = torch.Generator(device="cuda").manual_seed(0)
    cache = torch.randn(64, 2, 16, 8, 128, device="cuda", generator=g).to(torch.bfloat16)
    tables = torch.randperm(64, device="cuda", generator=g).view(4, 16).int()
    q = torch.randn(8, 32, 128, device="cuda", generator=g).to(torch.bfloat16)
    lengths = torch.tensor([200, 37, 129, 5], device="cuda", dtype=torch.int32)
    starts = torch.tensor([0, 5, 6, 7, 8], device="cuda", dtype=torch.int32)
    seq, vis = token_positions(starts, lengths)
    many = paged_attention(q, cache[:, 0], cache[:, 1], tables, seq, vis, 0.09, 128, 16)
    for j in range(5):
        s1 = torch.tensor([0, 1], device="cuda", dtype=torch.int32)
        l1 = torch.tensor([196 + j], device="cuda", dtype=torch.int32)
        seq1, vis1 = token_positions(s1, l1)
        alone = paged_attention(q[j:j + 1], cache[:, 0], cache[:, 1], tables[:1], seq1, vis1,
                                0.09, 128, 16)
        assert torch.equal(alone[0], many[j])


def test_speculative_greedy_bit_exact_in_batch_invariant_mode() -> None:
    from kernelbay import Policy, Registry
    from kernelbay.demo import demo_path, heldout_text
    from kernelbay.engine import LLM, SamplingParams, SpeculativeConfig

    policy = Policy(plugins=frozenset({"batch_invariant"}), batch_invariant=True)
    plain = LLM(demo_path(), dtype="bfloat16", registry=Registry.discover(policy), max_num_seqs=16)
    spec = LLM(demo_path(), dtype="bfloat16", registry=Registry.discover(policy), max_num_seqs=16,
               speculative=SpeculativeConfig("ngram", 4))
    chosen = {d.chosen for d in plain.plan.linears}
    assert plain.plan.attention.chosen == "bi-triton-mla"
    assert chosen <= {"bi-triton-linear", "bi-triton-moe"}, chosen
    text = heldout_text()
    prompts = [plain.encode(text[s:s + 120]) for s in range(0, 4000, 250)]
    params = SamplingParams(max_tokens=96, ignore_eos=True)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    outputs = spec.generate(prompts, params)
    assert [o.token_ids for o in outputs] == expected
    assert sum(len(o.token_ids) for o in outputs) / sum(o.steps for o in outputs) > 1.0
    alone = [plain.generate([p], params)[0].token_ids for p in prompts[:4]]
    assert alone == expected[:4]  # and the batch does not change a request's tokens
