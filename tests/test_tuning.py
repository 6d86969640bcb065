"""Launch tuning, step launch names, split counts and the token range check: no GPU needed."""

import dataclasses

import numpy as np
import pytest

from engine.errors import GDecodeError, check_tokens
from kernels.numerics import active_splits, softmax_scale2
from kernels.tuning import AttnTuning, GemvTuning, PrefillTuning, Tuning


def test_tuning_is_frozen_and_checked():
    t = Tuning(splits=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.splits = 9
    assert dataclasses.replace(t, attn=AttnTuning(min_chunk=3)).attn.min_chunk == 3 and t.attn.min_chunk == 64
    with pytest.raises(AssertionError):
        AttnTuning(warps=3)
    with pytest.raises(AssertionError):
        AttnTuning(min_chunk=0)
    with pytest.raises(AssertionError):
        AttnTuning(one_split_rows=-1)
    with pytest.raises(AssertionError):
        AttnTuning(one_split_heads=-1)
    with pytest.raises(AssertionError):
        PrefillTuning(attn_warps=16)  # prefill_attn's launch bounds want 8 / warps blocks per SM


@pytest.mark.parametrize("n_cached,splits,min_chunk,want", [
    (1, 32, 64, 1), (64, 32, 64, 1), (65, 32, 64, 2), (2048, 32, 64, 32), (10**6, 32, 64, 32),
    (7, 8, 1, 7), (8, 8, 1, 8), (9, 8, 1, 8), (10, 128, 3, 4), (0, 8, 1, 1),
])
def test_active_splits(n_cached, splits, min_chunk, want):
    assert active_splits(n_cached, splits, AttnTuning(min_chunk=min_chunk, one_split_rows=0), 128) == want


@pytest.mark.parametrize("head_dim,n_cached,want", [
    (128, 1, 1), (128, 129, 1), (128, 256, 1), (128, 257, 5), (128, 320, 5), (128, 321, 6), (128, 10**6, 32),
    (64, 256, 1), (64, 512, 1), (64, 513, 9), (64, 10**6, 32), (16, 2048, 1), (16, 2049, 32),
])
def test_one_split_up_to_its_rows(head_dim, n_cached, want):
    """The default tuning: one split (no merge) up to the rows whose bf16 K and V take 128 KiB (256 rows of
    head_dim 128, 512 of 64), then splits of at least 64 rows."""
    t = AttnTuning()
    assert (t.min_chunk, t.one_split_rows, t.one_split_kib) == (64, None, 128)
    assert t.one_split_limit(head_dim) == 128 * 1024 // (4 * head_dim)
    assert active_splits(n_cached, 32, t, head_dim) == want
    assert AttnTuning(one_split_rows=100).one_split_limit(head_dim) == 100, "rows given outright win"


def test_one_split_heads_per_block():
    """One query head per block by default; 0 is the whole group; a share must divide the group."""
    assert [AttnTuning().heads_per_block(g) for g in (1, 3, 4, 7)] == [1, 1, 1, 1]
    assert AttnTuning(one_split_heads=0).heads_per_block(7) == 7
    assert AttnTuning(one_split_heads=2).heads_per_block(4) == 2
    with pytest.raises(ValueError, match="does not divide"):
        AttnTuning(one_split_heads=3).heads_per_block(4)


def test_attention_builder_refuses_a_head_share_that_does_not_divide_the_group():
    from kernels.attention import attn_decode

    with pytest.raises(ValueError, match="does not divide"):
        attn_decode(0, 0, 0, 0, 0, 0, 0, 0, 0, nh=8, kv_heads=2, hd=16, splits=4, max_ctx=8,
                    tuning=AttnTuning(one_split_heads=3))


def test_softmax_scale2_is_base_2():
    assert softmax_scale2(64) == pytest.approx(64**-0.5 / np.log(2))


def test_attention_builder_refuses_splits_past_its_limit():
    from kernels.attention import ATTN_MAX_SPLITS, attn_decode

    for splits in (0, ATTN_MAX_SPLITS + 1):
        with pytest.raises(ValueError, match="splits"):
            attn_decode(0, 0, 0, 0, 0, 0, 0, 0, 0, nh=4, kv_heads=2, hd=16, splits=splits, max_ctx=8)


def test_step_launch_names():
    from graphs.decode import STEP_KINDS, Launches

    assert Launches.kind("layer12.attn") == "attn" and Launches.kind("lm_head") == "lm_head"

    class Fake:
        name = "gemv"

    out = Launches()
    out.add(Fake(), "layer0.o_proj")
    assert out[0].name == "layer0.o_proj" and "o_proj" in STEP_KINDS
    with pytest.raises(AssertionError):
        out.add(Fake(), "layer0.attn_partial")


def test_check_tokens():
    check_tokens([0, 5, 9], 10, 3)
    check_tokens([], 10, 0, start=0)
    check_tokens(np.array([1, 2]), 10, 8, start=6)
    with pytest.raises(GDecodeError, match="2 tokens at position 7 do not fit the context of 8 positions"):
        check_tokens([1, 2], 10, 8, start=7)
    with pytest.raises(GDecodeError, match="1 token at position 8 does not fit"):
        check_tokens([1], 10, 8, start=8)
    with pytest.raises(GDecodeError, match="not fit"):
        check_tokens([1], 10, 8, start=-1)
    for bad in ([10], [-1], [3, 10]):
        with pytest.raises(GDecodeError, match=r"out of range \[0, 10\)"):
            check_tokens(bad, 10, 8)


@pytest.mark.parametrize("chunk", [512, 100, 64, 1])
def test_prefill_gemm_rows_are_few_shapes_that_cover_every_chunk(chunk):
    """Every chunk of t tokens runs its GEMMs on gemm_rows(t) rows: at least t, at most the scratch's
    chunk, and one of the few row counts the load warms up, wasting less than 64 rows (or half)."""
    from kernels.prefill_ops import gemm_buckets, gemm_rows

    buckets = gemm_buckets(chunk)
    assert len(buckets) <= 15
    for t in range(1, chunk + 1):
        g = gemm_rows(t, chunk)
        assert t <= g <= chunk and g in buckets
        assert g - t < 64 and (t > 64 or g < 2 * t)
    assert buckets[-1] == chunk


def test_the_first_batch_waits_only_where_that_measured_faster():
    """EARLY_BATCH=0 exactly for Q8_0 and Q4_0 GEMVs of one block per SM and rows of at most 4,096 weights."""
    from kernels.gemv_ops import QuantWeight, _own_shape, _quant_defines

    def early(w, k, tuning=GemvTuning()):
        return "EARLY_BATCH" not in _quant_defines(w, k, _own_shape(w, k, tuning), 0)

    def q(fmt, k):
        return QuantWeight(fmt, 64, k, None)

    assert not early(q("q8_0", 4096), 4096) and not early(q("q4_0", 2048), 2048)
    assert early(q("q8_0", 14336), 14336)  # down's long rows
    assert early(q("q8_0", 896), 896)  # rows of at most 1,024 weights: two blocks per SM
    assert early(q("q4_k", 4096), 4096) and early(q("q6_k", 4096), 4096) and early(q("q4_1", 4096), 4096)
    assert early(q("q8_0", 4096), 4096, GemvTuning(quant_late_formats=()))
    bf16 = np.zeros((64, 4096), np.uint16)
    assert early(bf16, 4096) and not early(bf16, 4096, GemvTuning(late_kmax=4096))


def test_trigger_first_where_asked_and_the_grid_leaves_room():
    from kernels.gemv_ops import trigger_defines
    from kernels.tuning import TRIGGER_KINDS

    assert Tuning().trigger_first == () and {"qkv_proj", "o_proj"} <= set(TRIGGER_KINDS)
    # qwen2.5-0.5b's QKV: 72 blocks of the 264 slots of 8-warp blocks, two per SM on 132 SMs
    assert trigger_defines(True, 72, 2, sms=132) == {"PDL_TRIGGER_FIRST": 1}
    assert trigger_defines(True, 264, 2, sms=132) == {}  # the 8B's: every slot taken
    assert trigger_defines(True, 131, 1, sms=132) == {"PDL_TRIGGER_FIRST": 1}
    assert trigger_defines(False, 72, 2, sms=132) == {}
    with pytest.raises(ValueError, match="'sample' is not one of"):
        Tuning(trigger_first=("sample",))
