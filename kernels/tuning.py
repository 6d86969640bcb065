"""Kernel tuning as explicit, frozen values handed to the launch builders (never patched module globals)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class GemvTuning:
    warps: int = 8  # warps per block (bf16)
    min_blocks: int = 2  # blocks per SM the register cap allows (warps * min_blocks resident warps)
    rows: int = 4  # rows per warp for many short rows (a small model's lm_head)
    waves: int = 1  # grid = waves blocks per resident slot, rows striding over it; 0: one block per row group
    # bf16: split K further where that fills the last pass over the resident warps better (gemv_ops._balanced);
    # 0: off, 1: only matrices with a unit for every warp, 2: all
    balance: int = 1
    late_kmax: int = 0  # bf16 rows of at most this many weights load their first batch after the PDL wait
    # o_proj follows attention, whose few blocks leave most SMs free at short contexts: there one warp per row
    # (no split over K) where every row's weights then fit the warps' first batch, all loaded before the PDL wait
    # (docs/PERFORMANCE.md, "Small models": llama3.2-1b +2.6%)
    o_whole: bool = True
    quant_rows: int = 2  # rows per warp of the block-format GEMVs (each x load serves them all)
    # ... where quant_rows rows per warp would leave each warp at most one unit (an 8B's 4096-row o_proj and
    # down) and the format has below 8 bits per weight: two units per warp keep each warp streaming
    quant_few_rows: int = 1
    quant_warps: int = 16  # their warps per block: one block per SM stages x once for 16 warps
    quant_min_blocks: int = 1  # their register cap: 128
    quant_short_rows: int = 4  # rows of at most 1024 weights: more rows keep as many bytes in flight
    quant_short_warps: int = 8  # ... and smaller blocks, a finer grid for their smaller matrices
    quant_short_min_blocks: int = 2
    quant_x_smem: bool = True  # fp32 x: blocks copy x (times gamma) to shared memory once, for unit-stride reads
    quant_int8_x: bool = True  # x quantized to int8 per 32 (ggml's q8_1), dot products by dp4a; else fp32 x
    # the first batch of weights is loaded before the PDL wait, except in these formats' GEMVs whose block
    # takes a whole SM and whose rows hold at most quant_late_kmax weights: there it is loaded after the wait
    # (docs/PERFORMANCE.md, "Quantized weights": the 8B's Q8_0 +2.9%, Q4_0 +3.6%; Q4_K_M -0.6%)
    quant_late_formats: tuple[str, ...] = ("q8_0", "q4_0")
    quant_late_kmax: int = 4096
    quant_unroll: int = 0  # chunk loads per row and batch; 0: 8 / rows with int8 x (fp32 x: what 32 registers hold)
    quant_units_per_sm: int = 12  # units (rows per warp each) in flight per SM that the split over K aims for
    # a projection stored as parts of several formats (a Q4_K_M layer's Q6_K v beside Q4_K q and k) runs one
    # launch per part; each part after the first streams without waiting for the one before (LATE_WAIT)
    parts_overlap: bool = True


# the fp32-x block-format GEMVs in the shape they were tuned in (their unpacking needs 168 registers)
FP32_X = GemvTuning(quant_int8_x=False, quant_rows=4, quant_warps=4, quant_min_blocks=3, quant_short_rows=4,
                    quant_short_warps=4, quant_short_min_blocks=3)

@dataclass(frozen=True)
class AttnTuning:
    warps: int = 8  # warps per attn_decode block
    min_chunk: int = 64  # cache rows per active split at least
    # up to this many cached rows, one split takes them all: merging splits costs more than they save there
    # (docs/PERFORMANCE.md, "One split at short contexts"); None: the rows whose K and V take one_split_kib
    one_split_rows: int | None = None
    one_split_kib: int = 128
    # ... where the blocks of a kv head take its query heads apart, this many each (a divisor of the group;
    # 0: the whole group, one block per kv head)
    one_split_heads: int = 1

    def __post_init__(self):
        assert self.warps in (1, 2, 4, 8, 16) and self.min_chunk >= 1, self
        assert (self.one_split_rows is None or self.one_split_rows >= 0) and self.one_split_kib >= 0, self
        assert self.one_split_heads >= 0, self

    def one_split_limit(self, head_dim: int) -> int:
        """Cached rows up to which one split takes them all, for bf16 K and V rows of head_dim."""
        if self.one_split_rows is not None:
            return self.one_split_rows
        return self.one_split_kib * 1024 // (2 * 2 * head_dim)

    def heads_per_block(self, group: int) -> int:
        """Query heads that each block of one split takes, for a group of `group` query heads per kv head."""
        h = self.one_split_heads or group
        if group % h:
            raise ValueError(f"one_split_heads {h} does not divide the {group} query heads of a kv head")
        return h


@dataclass(frozen=True)
class PrefillTuning:
    chunk: int = 512  # prompt positions per pass (the scratch buffers' row count)
    attn_warps: int = 4  # warps per prefill_attn block (16 query rows each)
    row_warps: int = 4  # warps per block of the per-token row kernels (one row or head each)
    # a side stream dequantizes the next block-format matrix into a second scratch during each GEMM
    dequant_ahead: bool = True
    # the GEMMs compute kernels/prefill_ops.gemm_rows(T) rows, a few shapes that the load warms up
    pad_rows: bool = True

    def __post_init__(self):
        assert self.chunk >= 1 and self.attn_warps in (1, 2, 4, 8) and self.row_warps >= 1, self


@dataclass(frozen=True)
class Tuning:
    """Everything a step builder needs to choose launch shapes; one value per model load."""

    gemv: GemvTuning = field(default_factory=GemvTuning)
    attn: AttnTuning = field(default_factory=AttnTuning)
    prefill: PrefillTuning = field(default_factory=PrefillTuning)
    rope_warps: int = 4  # warps per rope_append block (one head each)
    splits: int | None = None  # attention splits; None: one full wave of resident blocks
    # the step's launches of these kinds (graphs/decode.STEP_KINDS) let the next kernel's blocks launch before
    # their own PDL wait rather than after it (common.cuh PDL_TRIGGER_FIRST), the GEMVs where their grid leaves
    # resident slots free. Same bits either way (tests/test_trigger_first_gpu.py); off, as it gains on the
    # smallest shape only and loses on others (docs/PERFORMANCE.md, "Small models")
    trigger_first: tuple[str, ...] = ()

    def __post_init__(self):
        for kind in self.trigger_first:
            if kind not in TRIGGER_KINDS:
                raise ValueError(f"trigger_first: {kind!r} is not one of {', '.join(TRIGGER_KINDS)}")


# the launches of the step that may let the next kernel launch before their own PDL wait
TRIGGER_KINDS = ("qkv_proj", "attn", "o_proj", "gate_up", "down_proj", "lm_head")
