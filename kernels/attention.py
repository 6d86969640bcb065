"""Launch builder of split-KV decode attention (kernels/attention.cu)."""

from __future__ import annotations

import functools

from kernels.launch import Launch
from kernels.numerics import softmax_scale2
from kernels.ops import module
from kernels.tuning import AttnTuning

# the merging block weighs every split's partial from registers and shared memory sized for this many
ATTN_MAX_SPLITS = 128


def _module(hd: int, group: int, warps: int, heads: int, trigger_first: bool = False):
    return module("attention", HEAD_DIM=hd, GROUP=group, WARPS=warps, MAX_SPLITS=ATTN_MAX_SPLITS,
                  ONE_SPLIT_HEADS=heads, **({"PDL_TRIGGER_FIRST": 1} if trigger_first else {}))


def attn_blocks_per_sm(hd: int, group: int, tuning: AttnTuning = AttnTuning()) -> int:
    """How many attn_decode blocks fit on one SM at once (registers and shared memory)."""
    return _occupancy(hd, group, tuning.warps, tuning.heads_per_block(group))


@functools.cache
def _occupancy(hd: int, group: int, warps: int, heads: int) -> int:
    from cuda.bindings import driver

    from kernels.cuda import check

    fn = _module(hd, group, warps, heads).function("attn_decode")
    return max(1, check(driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(fn.func, warps * 32, 0),
                        "cuOccupancyMaxActiveBlocksPerMultiprocessor"))


def attn_decode(q, k_cache, v_cache, state, pm, pl, pacc, out, counters, *, nh: int, kv_heads: int, hd: int,
                splits: int, max_ctx: int, tuning: AttnTuning = AttnTuning(), pdl: bool = False,
                trigger_first: bool = False) -> Launch:
    """Split-KV attention over min(splits, ceil(n_cached / min_chunk)) splits, merged by the last block;
    one split (no merge) up to tuning.one_split_limit(hd) cached rows, its blocks taking
    tuning.heads_per_block(nh // kv_heads) query heads each.

    q: [nh * hd] f32; k_cache, v_cache: [kv_heads, max_ctx, hd] bf16; pm, pl: [nh, splits] and
    pacc: [nh, splits, hd] f32 partials; out: [nh * hd] f32.
    counters: [kv_heads] uint32, zero before the first launch; each launch leaves them zero. trigger_first: the
    next kernel may launch before this one's PDL wait.
    """
    if not 1 <= splits <= ATTN_MAX_SPLITS:
        raise ValueError(f"attention splits must be in [1, {ATTN_MAX_SPLITS}], got {splits}")
    group = nh // kv_heads
    mod = _module(hd, group, tuning.warps, tuning.heads_per_block(group), trigger_first)
    return mod.function("attn_decode", "PPPPPPPPPifii").prepare(
        (splits, kv_heads), tuning.warps * 32,
        [q, k_cache, v_cache, state, pm, pl, pacc, out, counters, max_ctx, softmax_scale2(hd), tuning.min_chunk,
         tuning.one_split_limit(hd)],
        pdl=pdl, name="attn")
