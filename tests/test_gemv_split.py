"""How the bf16 GEMVs split K over warps (kernels/gemv_ops.split_k), on an H200's 132 SMs."""

from __future__ import annotations

import pytest

from kernels.gemv_ops import QuantWeight, split_k, whole_first_batch
from kernels.tuning import GemvTuning

H200_SMS = 132


def split(units: int, k: int, **tuning) -> int:
    return split_k(units, k // 8, False, GemvTuning(**tuning), sms=H200_SMS)


def test_balance_splits_a_last_pass_that_would_leave_a_quarter_of_the_warps_idle():
    # llama3.2-1b's QKV: 1,536 rope pairs of 2,048 weights. Two warps per pair give 3,072 tasks over 2,112
    # resident warps (a second pass 45% full); four give 6,144, three passes 97% full.
    assert split(1536, 2048, balance=0) == 2
    assert split(1536, 2048) == 4


def test_balance_keeps_two_chunks_per_lane():
    # qwen2.5-0.5b's gate/up: 4,864 units of 896 weights (112 chunks); two warps would fill the passes
    # better but leave 1.75 chunks per lane
    assert split(4864, 896, balance=2) == 1


def test_balance_one_leaves_a_matrix_with_fewer_units_than_warps_alone():
    # smollm2's down: 576 rows of 1,536 weights, a quarter of the warps busy
    assert split(576, 1536, balance=1) == 1
    assert split(576, 1536, balance=2) == 2


@pytest.mark.parametrize("units,k", [(3072, 4096), (4096, 14336), (14336, 4096), (64128, 2048)])
def test_balance_leaves_well_filled_matrices_alone(units, k):
    # the 8B's QKV, down and gate/up, the 1B's lm_head: their last pass is nearly full already
    assert split(units, k) == split(units, k, balance=0)


def test_the_split_never_passes_the_warps_of_a_block():
    for units in range(1, 5000, 97):
        for k in (64, 576, 896, 2048, 8192):
            s = split(units, k, balance=2)
            assert s in (1, 2, 4, 8) and s <= GemvTuning().warps


def test_o_proj_takes_whole_rows_where_all_its_weights_then_load_before_the_wait():
    t, bf16 = GemvTuning(), object()

    def whole(units, k, rows=1, w=bf16):
        return whole_first_batch(w, units, k, rows, t, sms=H200_SMS)

    # llama3.2-1b: 2,048 rows over 2,112 resident warps, 8 chunks a lane (the batch of one row a warp)
    assert whole(2048, 2048) and split(2048, 2048) == 2
    assert whole(896, 896) and whole(576, 576)  # qwen2.5-0.5b, smollm2: unsplit already
    assert not whole(4096, 4096)  # the 8B: more rows than warps
    assert not whole(2000, 4096)  # 16 chunks a lane: two batches
    assert not whole(2048, 2048, rows=2)  # two rows a warp: a batch of 4 chunks each
    assert not whole(2048, 2048, w=QuantWeight("q8_0", 2048, 2048, None))
