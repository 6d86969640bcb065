"""The order in which the prefill dequantizes block-format matrices ahead (graphs/dequant_gemm.py):
each GEMM starts the next one's dequantization only into the other scratch, wrapping around to the
first GEMM of the next chunk."""

import pytest

from graphs.dequant_gemm import ahead_plan
from kernels.prefill_ops import dequant_items


@pytest.mark.parametrize("count", [1, 2, 3, 4, 7, 128, 129])
@pytest.mark.parametrize("slots", [1, 2])
def test_ahead_plan_never_overwrites_the_scratch_a_gemm_reads(count, slots):
    slot, nxt = ahead_plan(count, slots)
    assert all(0 <= s < slots for s in slot)
    for i in range(count):
        j = (i + 1) % count
        if slot[j] != slot[i]:
            assert nxt[i] == j  # the next GEMM's matrix is on its way while GEMM i runs
        else:
            assert nxt[i] is None
    if slots == 2 and count > 1:
        # neighbours alternate, so only the wrap of an odd count loses its head start
        assert sum(n is None for n in nxt) == count % 2


def test_items_scale_with_the_chunk():
    assert [dequant_items(f, 4) for f in ("q8_0", "q4_k", "q6_k", "q2_k", "q3_k")] == [8, 4, 4, 2, 2]
    assert dequant_items("q2_k", 1) == 1
