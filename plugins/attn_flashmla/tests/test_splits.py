"""The decode launch's split count: the occupancy arithmetic and the wave cost model."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from kernelbay_attn_flashmla.triton_mla import (
    MAX_SPLITS,
    MIN_SPLIT_KEYS,
    choose_splits,
    programs_per_sm,
    split_cost,
)


def test_programs_per_sm_matches_the_profiler() -> None:
    # Nsight Compute on the H200 (bench/results/profiles/mla-mxfp8-detail-h200-ncu.txt):
    # 255 registers, 4 warps -> "Block Limit Registers 2".
    assert programs_per_sm(255, 49_152, 4) == 2
    # Registers go per warp in units of 256 from a scheduler's quarter (16384): 168 x 32 =
    # 5376 a warp, three warps a quarter, twelve an SM.
    assert programs_per_sm(168, 0, 4) == 3
    assert programs_per_sm(255, 0, 8) == 1
    # Shared memory limits too: 100 KB blocks, two per 228 KB SM.
    assert programs_per_sm(64, 100 * 1024, 4) == 2
    # Never more than the SM's 2048 threads.
    assert programs_per_sm(16, 0, 4) == 16


@pytest.mark.parametrize("tokens", [1, 16, 64, 128])
@pytest.mark.parametrize("keys", [1024, 8192, 32768])
@pytest.mark.parametrize("resident", [1, 2, 3])
@pytest.mark.parametrize("min_keys", [MIN_SPLIT_KEYS, 128])
def test_choice_is_the_cheapest_allowed(tokens: int, keys: int, resident: int,
                                        min_keys: int) -> None:
    sms, block_n, bpt, partial = 132, 32, 528, 16 * 448 * 4
    splits = choose_splits(tokens, 1, keys, sms, resident, block_n=block_n, bytes_per_key=bpt,
                           partial_bytes=partial, min_split_keys=min_keys)
    allowed = range(1, max(1, min(MAX_SPLITS, keys // min_keys)) + 1)
    assert splits in allowed
    costs = {s: split_cost(s, tokens, sms * resident, keys, block_n, bpt, partial)
             for s in allowed}
    assert costs[splits] == min(costs.values())
    assert all(s >= splits for s, c in costs.items() if c == costs[splits])


def test_cost_counts_partial_waves_as_whole() -> None:
    # 64 programs per split on 264 slots: 4 splits are one wave, 5 splits two.
    one = split_cost(4, 64, 264, 8192, 32, 528, 28_672)
    two = split_cost(5, 64, 264, 8192, 32, 528, 28_672)
    assert two == 2 * (1664 * 528 + 2 * 28_672) and one == 2048 * 528 + 2 * 28_672
    assert one < two
    # No partial to write or combine without a split.
    assert split_cost(1, 264, 264, 8192, 32, 528, 28_672) == 8192 * 528


def test_a_lone_sequence_spreads_over_the_sms() -> None:
    # One token, 32k keys, 132 SMs: the split count grows to the cap rather than leave SMs idle.
    assert choose_splits(1, 1, 32768, 132, 2, block_n=32, bytes_per_key=528,
                         partial_bytes=16 * 448 * 4) == MAX_SPLITS
    # A batch that fills every slot by itself is not split.
    assert choose_splits(264, 1, 8192, 132, 2, block_n=32, bytes_per_key=528,
                         partial_bytes=16 * 448 * 4) == 1


def test_the_cuda_kernel_splits_finer_only_below_one_cta_per_sm() -> None:
    from kernelbay_attn_flashmla.cuda_mla import MIN_SPLIT_TILES, choose_cuda_splits

    geometry = dict(num_sms=132, resident=3, tile=32, bytes_per_key=528,
                    partial_bytes=16 * 448 * 4)
    common = dict(block_n=32, bytes_per_key=528, partial_bytes=16 * 448 * 4)
    # One 8k-key sequence: the Triton kernel's minimum stops at 32 splits of 256 keys; four
    # 32-key tiles per split give the CUDA kernel 64 CTAs, still one per SM at most.
    assert choose_splits(1, 1, 8192, 132, 3, **common) == 32
    assert choose_cuda_splits(1, 8192, **geometry) == 64 == choose_splits(
        1, 1, 8192, 132, 3, **common, min_split_keys=MIN_SPLIT_TILES * 32)
    assert choose_cuda_splits(16, 1024, **geometry) == 8
    # Finer splits that would put more than one CTA on an SM: the coarser minimum's count.
    for programs, keys in ((64, 1024), (8, 8192), (16, 8192), (64, 32768)):
        fine = choose_splits(programs, 1, keys, 132, 3, **common,
                             min_split_keys=MIN_SPLIT_TILES * 32)
        coarse = choose_splits(programs, 1, keys, 132, 3, **common)
        assert choose_cuda_splits(programs, keys, **geometry) == (
            fine if programs * fine <= 132 else coarse)
    assert choose_cuda_splits(64, 1024, **geometry) == 4
    assert choose_cuda_splits(8, 8192, **geometry) == 32
