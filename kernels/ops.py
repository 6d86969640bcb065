"""Launch builders for the decode kernels: each returns a prepared Launch over fixed buffers."""

from __future__ import annotations

import functools
import math

from kernels.launch import Launch, Module
from kernels.tuning import Tuning

SAMPLE_BLOCK = 1024
SAMPLE_CAP = 4096


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


def sample(logits, amax, state, prompt, ring, scratch_z, scratch_i, *, vocab: int, max_ctx: int,
           pdl: bool = False) -> Launch:
    mod = module("sample", BLOCK=SAMPLE_BLOCK, CAP=SAMPLE_CAP)
    return mod.function("sample", "PPPPPPPii").prepare(
        1, SAMPLE_BLOCK, [logits, amax, state, prompt, ring, scratch_z, scratch_i, vocab, max_ctx], pdl=pdl)


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
