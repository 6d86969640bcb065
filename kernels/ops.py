"""Launch builders for the decode kernels: each returns a prepared Launch over fixed buffers."""

from __future__ import annotations

import functools
import math

from kernels.launch import Launch, Module
from kernels.tuning import Tuning

SAMPLE_BLOCK = 512
SAMPLE_SLICE = 1024  # logits per sampler block at least: fewer, larger blocks for a small vocabulary
SAMPLE_MAX_PER = 8  # logits per sampler thread at most (registers)
SAMPLE_MAX_BLOCKS = 128  # the merges gather every block's lists into shared memory
SAMPLE_MAX_RECORDS = 64  # records kept per block and overall
SAMPLE_MAX_LOGPROBS = 20  # log-probabilities per token at most (engine/sampling.py MAX_LOGPROBS)
SAMPLE_LP_WORDS = 44  # int32 words of one log-probability ring slot: token, logprob, n, (id, logprob) x MAX_LOGPROBS


@functools.cache
def module(source: str, **defines) -> Module:
    """The loaded module of kernels/<source>.cu for these defines (compiled once, cached on disk)."""
    return Module.load(source, defines)


@functools.cache
def sm_count() -> int:
    from kernels.cuda import device_attribute

    return device_attribute("MULTIPROCESSOR_COUNT")


EMBED_BLOCK = 256
FILL_BLOCK, FILL_BLOCKS_PER_SM = 256, 64


def embed(table, state, x, vocab: int, hidden: int, pdl: bool = False) -> Launch:
    """x [hidden] f32 = table[state.token] (clamped into the vocabulary); table [vocab, hidden] bf16."""
    threads = hidden // 8  # 8 bf16 (16 bytes) per thread
    block = min(EMBED_BLOCK, threads)
    return module("embed", HIDDEN=hidden).function("embed", "PPPi").prepare(
        math.ceil(threads / block), block, [table, state, x, vocab], pdl=pdl)


def rope_append(qkv, q_norm, k_norm, cos, sin, state, k_cache, v_cache, *, nh: int, kv_heads: int, hd: int,
                max_ctx: int, eps: float, warps: int = Tuning.rope_warps, pdl: bool = False) -> Launch:
    """q/k RMSNorm (when q_norm is given), RoPE at the state's position, and the K/V append; one warp per head."""
    mod = module("rope", HEAD_DIM=hd, QK_NORM=int(q_norm is not None), WARPS=warps)
    return mod.function("rope_append", "PPPPPPPPiiif").prepare(
        math.ceil((nh + kv_heads) / warps), warps * 32,
        [qkv, q_norm, k_norm, cos, sin, state, k_cache, v_cache, nh, kv_heads, max_ctx, eps], pdl=pdl)


def sample_shape(vocab: int, sms: int) -> tuple[int, int]:
    """(blocks, logits per thread) of the sampler: a block per SAMPLE_SLICE logits, at most one per SM
    (its grid barrier needs every block resident at once)."""
    grid = max(1, min(math.ceil(vocab / SAMPLE_SLICE), sms, SAMPLE_MAX_BLOCKS))
    per = math.ceil(vocab / (grid * SAMPLE_BLOCK))
    if per > SAMPLE_MAX_PER:
        raise ValueError(f"a vocabulary of {vocab} needs more than {SAMPLE_MAX_PER} logits per sampler thread")
    grid = math.ceil(vocab / (per * SAMPLE_BLOCK))  # no block left without logits
    return grid, per


def sample_work_words(grid: int) -> int:
    """uint64 words of the sampler's scratch (kernels/sample.cu's layout: a header, two [MAX_RECORDS + 1]
    accumulators, the overall records as MAX_RECORDS (key, z key) pairs, then per block its record count,
    MAX_RECORDS (key, z key) pairs and MAX_LOGPROBS raw keys)."""
    return (8 + 2 * (SAMPLE_MAX_RECORDS + 1) + 2 * SAMPLE_MAX_RECORDS
            + grid * (1 + 2 * SAMPLE_MAX_RECORDS + SAMPLE_MAX_LOGPROBS))


def sample(logits, amax, state, tokens, ring, lp_ring, counts, window, work, *, vocab: int, max_ctx: int,
           pdl: bool = False) -> Launch:
    """Pick the next token (engine/sampling.py's rule), advance the state and write the host rings.

    tokens [max_ctx] int32: the context, the sampler appends to it; ring [R] and lp_ring [R, SAMPLE_LP_WORDS]
    int32: host-mapped rings (device addresses); counts, window [vocab] int32: penalty counts;
    work: uint64 [sample_work_words(grid)], zero before the first launch.
    """
    grid, per = sample_shape(vocab, sm_count())
    mod = module("sample", BLOCK=SAMPLE_BLOCK, PER_THREAD=per, BLOCKS=grid, MAX_RECORDS=SAMPLE_MAX_RECORDS,
                 MAX_LOGPROBS=SAMPLE_MAX_LOGPROBS, LP_WORDS=SAMPLE_LP_WORDS, WORK_WORDS=sample_work_words(grid))
    return mod.function("sample", "PPPPPPPPPii").prepare(
        grid, SAMPLE_BLOCK, [logits, amax, state, tokens, ring, lp_ring, counts, window, work, vocab, max_ctx],
        pdl=pdl)


_GEMV_NAMES = ("gemv", "gemv_rope", "Epilogue", "EPI_STORE", "EPI_ADD", "EPI_SILU", "EPI_GATE", "QuantWeight",
               "GEMV_WARPS")


def __getattr__(name):
    # the GEMV builders live in kernels/gemv_ops.py (which imports this module: resolved lazily)
    if name in _GEMV_NAMES:
        from kernels import gemv_ops

        return getattr(gemv_ops, name)
    raise AttributeError(f"module 'kernels.ops' has no attribute {name!r}")


def _fill(name: str, out, seed: int, scale: float, offset: float, stream=None):
    n = out.size
    # a grid-stride loop: one element per thread, the grid capped at FILL_BLOCKS_PER_SM waves' worth
    grid = max(1, min(math.ceil(n / FILL_BLOCK), FILL_BLOCKS_PER_SM * sm_count()))
    module("fill", NONE=0).function(name, "PqQff").launch(grid, FILL_BLOCK, [out, n, seed % 2**64, scale, offset],
                                                           stream=stream)


def fill_bf16(out, seed: int, scale: float, offset: float = 0.0, stream=None):
    """out (uint16 bf16 bits) = offset + scale * uniform(-1, 1), hashed from (seed, index)."""
    _fill("fill_bf16", out, seed, scale, offset, stream)


def fill_f32(out, seed: int, scale: float, offset: float = 0.0, stream=None):
    _fill("fill_f32", out, seed, scale, offset, stream)
