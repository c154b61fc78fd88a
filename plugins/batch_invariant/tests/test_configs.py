"""The tiling table and the stage chooser (no device needed: shared memory is passed in)."""

from __future__ import annotations

import pytest
from kernelbay import LinearRequest, QuantScheme, parse_device
from kernelbay_batch_invariant.configs import (
    TABLE,
    MatmulConfig,
    choose_stages,
    matmul_config,
)
from kernelbay_batch_invariant.linear import BatchInvariantLinear

#: Opt-in shared memory per block: compute capability 8.9 (Ada), 8.0 (A100), 9.0 (H100/H200).
ADA, A100, HOPPER = 101376, 166912, 232448


def test_default_stages_overflow_small_parts_and_the_chooser_fits_them() -> None:
    big = MatmulConfig(128, 128, 64, 8, 4)
    assert big.num_stages * big.stage_bytes(4) > ADA  # the default would overflow
    fitted = choose_stages(big, 4, ADA)
    assert fitted.num_stages >= 1
    assert fitted.num_stages * fitted.stage_bytes(4) <= ADA
    assert (fitted.block_m, fitted.block_n, fitted.block_k) == (128, 128, 64)
    assert choose_stages(big, 4, HOPPER).num_stages == 3  # 3 x 64 KiB fit in 227 KiB
    assert choose_stages(big, 2, HOPPER).num_stages == 4  # bf16: all 4 x 32 KiB fit


@pytest.mark.parametrize("limit", [ADA, A100, HOPPER, 48 * 1024, 20 * 1024])
@pytest.mark.parametrize("n, k, dtype", [(1, 4096, "float32"), (1, 7, "float32"),
                                         (4096, 4096, "bfloat16"), (14336, 4096, "bfloat16"),
                                         (4096, 14336, "float16"), (160, 64, "float32")])
def test_every_config_fits_the_limit(n: int, k: int, dtype: str, limit: int) -> None:
    config = matmul_config(n, k, dtype, limit)
    itemsize = 4 if dtype == "float32" else 2
    assert config.num_stages * config.stage_bytes(itemsize) <= limit
    assert 1 <= config.num_stages <= 4


def test_too_small_a_limit_halves_block_k() -> None:
    config = choose_stages(MatmulConfig(64, 128, 64), 4, 40 * 1024)
    assert config.block_k == 32 and config.num_stages == 1
    floor = choose_stages(MatmulConfig(64, 128, 64), 4, 1024)
    assert floor.block_k == 16 and floor.num_stages == 1  # nothing fits: smallest, 1 stage


def test_more_memory_never_means_fewer_stages() -> None:
    base = MatmulConfig(64, 64, 64, 4, 4)
    stages = [choose_stages(base, 2, limit).num_stages for limit in (20000, 40000, 80000,
                                                                     HOPPER)]
    assert stages == sorted(stages) and stages[-1] == 4


def test_table_entries_and_rule() -> None:
    assert matmul_config(4096, 4096, "bfloat16", HOPPER) == TABLE[(4096, 4096, "bfloat16")]
    assert matmul_config(1, 64, "float32", HOPPER).block_n == 16
    assert matmul_config(32000, 4096, "bfloat16", HOPPER).block_n == 128
    with pytest.raises(ValueError, match=r"dtype 'int8' is not supported; valid: "):
        matmul_config(64, 64, "int8", HOPPER)


def test_linear_verdicts() -> None:
    ok = BatchInvariantLinear.can_implement(LinearRequest(64, 32), parse_device("sm_89"))
    assert ok.accepted
    cpu = BatchInvariantLinear.can_implement(LinearRequest(64, 32), parse_device("cpu"))
    assert not cpu.accepted and "device platform is 'cpu'" in cpu.reason
    fp8 = BatchInvariantLinear.can_implement(LinearRequest(64, 32, QuantScheme("fp8")),
                                             parse_device("sm_90"))
    assert not fp8.accepted and not fp8.applicable
    assert BatchInvariantLinear.batch_invariant


def test_the_stage_chooser_fits_the_whole_tile_stages_too() -> None:
    tuned = MatmulConfig(128, 128, 64, 8, 3, split_k=4, whole_tma=True, whole_stages=5)
    assert choose_stages(tuned, 2, HOPPER).whole_stages == 5  # 5 x 32 KiB fit in 227 KiB
    fitted = choose_stages(tuned, 2, 100 * 1024)
    assert (fitted.num_stages, fitted.whole_stages, fitted.whole_tma) == (3, 3, True)
    assert choose_stages(MatmulConfig(64, 64, 64), 2, HOPPER).whole_stages == 0  # own depth
    lone = MatmulConfig(64, 128, 64, 4, 4, split_k=4, whole_stages=4, lone_stages=6)
    assert choose_stages(lone, 2, HOPPER).lone_stages == 6  # 6 x 24 KiB fit in 227 KiB
    assert choose_stages(lone, 2, 100 * 1024).lone_stages == 4  # 4 x 24 KiB in 98 KiB
    assert choose_stages(MatmulConfig(64, 64, 64), 2, HOPPER).lone_stages == 0


def test_whole_tiles_from_the_configured_share_of_the_sms() -> None:
    from kernelbay_batch_invariant.kernels import runs_whole

    table = TABLE[(4096, 4096, "bfloat16")]  # 64 x 128 tiles, split 4, whole from 0.9 x SMs
    # M = 64 / 128 / 256 / 1024 on 132 SMs: 32 / 64 / 128 / 512 tiles
    assert [runs_whole(table, t, 132) for t in (32, 64, 128, 512)] == [False, False, True,
                                                                       True]
    plain = MatmulConfig(64, 128, 64, 4, 4, split_k=4)  # default: from one tile per SM
    assert [runs_whole(plain, t, 132) for t in (128, 132)] == [False, True]
    assert runs_whole(MatmulConfig(64, 128, 64), 1, 132)  # no split: always whole


def test_the_stage_chooser_keeps_the_split() -> None:
    split = MatmulConfig(64, 128, 64, 4, 4, split_k=4, sum_in_kernel=True)
    for limit in (ADA, 40 * 1024, 1024):
        fitted = choose_stages(split, 4, limit)
        assert (fitted.split_k, fitted.sum_in_kernel) == (4, True)
    for (n, k, dtype), entry in TABLE.items():
        config = matmul_config(n, k, dtype, HOPPER)
        assert config.split_k == entry.split_k >= 1
        assert config.sum_in_kernel == entry.sum_in_kernel
