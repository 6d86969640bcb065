"""Launch builders for batched prefill: per-token row kernels, causal flash attention, cuBLAS GEMMs.

Every prefill kernel takes (pos0, T) as its first two arguments and has a grid sized for the whole
chunk, so a ChunkLaunch is built once and only those two values change from chunk to chunk.
"""

from __future__ import annotations

import math

import numpy as np

from kernels.launch import Launch, device_pointer
from kernels.numerics import softmax_scale2
from kernels.ops import module, sm_count
from kernels.tuning import PrefillTuning

EMBED_BLOCK = 128
SILU_BLOCK = 256
_DEFAULT = PrefillTuning()

# cuBLAS enums, by their names in cublas_api.h and library_types.h
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUDA_R_32F, CUDA_R_16BF = 0, 14
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1
CUBLAS_POINTER_MODE_HOST = 0
_ONE = np.ones(1, np.float32)
_ZERO = np.zeros(1, np.float32)


class ChunkLaunch:
    """A prepared launch whose arguments 0 and 1 are the chunk's first position and length."""

    def __init__(self, launch: Launch):
        self.launch = launch

    def __call__(self, stream, pos0: int, t: int):
        self.launch.set_arg(0, pos0)
        self.launch.set_arg(1, t)
        self.launch(stream)


def _rows_module(hd: int = 16, qk_norm: bool = False, bias: bool = False, warps: int = _DEFAULT.row_warps):
    # embed_rows, rms_rows and silu_rows do not depend on the head defines: any valid head size builds them
    return module("prefill_rope", HEAD_DIM=hd, QK_NORM=int(qk_norm), BIAS=int(bias), WARPS=warps)


def embed_rows(table, prompt, x, *, chunk: int, hidden: int, vocab: int) -> ChunkLaunch:
    """x[t] = table[prompt[pos0 + t]] as fp32."""
    grid = (chunk, math.ceil(hidden // 8 / EMBED_BLOCK))
    fn = _rows_module().function("embed_rows", "iiPPPii")
    return ChunkLaunch(fn.prepare(grid, EMBED_BLOCK, [0, 0, table, prompt, x, vocab, hidden]))


def rms_rows(x, gamma, out, *, chunk: int, hidden: int, eps: float, warps: int = _DEFAULT.row_warps) -> ChunkLaunch:
    """out[t] = bf16(rmsnorm(x[t]) * gamma); one warp per row."""
    fn = _rows_module(warps=warps).function("rms_rows", "iiPPPif")
    return ChunkLaunch(fn.prepare(math.ceil(chunk / warps), warps * 32, [0, 0, x, gamma, out, hidden, eps]))


def rope_rows(qkv, bias, q_norm, k_norm, cos, sin, q_out, k_cache, v_cache, *, chunk: int, nh: int, kv_heads: int,
              hd: int, max_ctx: int, eps: float, warps: int = _DEFAULT.row_warps) -> ChunkLaunch:
    """Bias, q/k RMSNorm and RoPE of each token; q to q_out (scaled for base-2 softmax), k/v into the cache."""
    mod = _rows_module(hd, q_norm is not None, bias is not None, warps)
    fn = mod.function("rope_rows", "iiPPPPPPPPPiiiff")
    grid = (chunk, math.ceil((nh + kv_heads) / warps))
    args = [0, 0, qkv, bias, q_norm, k_norm, cos, sin, q_out, k_cache, v_cache, nh, kv_heads, max_ctx, eps,
            softmax_scale2(hd)]
    return ChunkLaunch(fn.prepare(grid, warps * 32, args))


def silu_rows(gu, act, *, chunk: int, inter: int) -> ChunkLaunch:
    """act[t] = bf16(silu(gate[t]) * up[t]) with gu[t] = gate | up."""
    fn = _rows_module().function("silu_rows", "iiPPi")
    # grid-stride loop over the chunk: at most 8 blocks per SM
    grid = max(1, min(math.ceil(chunk * inter / 4 / SILU_BLOCK), 8 * sm_count()))
    return ChunkLaunch(fn.prepare(grid, SILU_BLOCK, [0, 0, gu, act, inter]))


ATTN_KV_TILE = 64  # cache rows per K/V tile of prefill_attn (its KV_TILE)
ATTN_STAGES = 2  # cp.async double buffering
ATTN_ROW_PAD = 8  # bf16 elements of padding per shared-memory row (16 bytes: ldmatrix reads no bank twice)


def attn_smem(hd: int) -> int:
    """Dynamic shared memory of prefill_attn: each stage holds a K and a V tile of padded bf16 rows."""
    return ATTN_STAGES * 2 * ATTN_KV_TILE * (hd + ATTN_ROW_PAD) * 2


def attn_max_group(warps: int = _DEFAULT.attn_warps) -> int:
    """The largest GQA group prefill_attn takes: a block's 16 * warps query rows hold at least one token."""
    return 16 * warps


def prefill_attn(q, k_cache, v_cache, out, *, chunk: int, nh: int, kv_heads: int, hd: int, max_ctx: int,
                 warps: int = _DEFAULT.attn_warps) -> ChunkLaunch:
    """Causal attention of the chunk's queries over cache rows [0, pos0 + t] -> out [chunk, nh * hd] bf16.

    A block takes 16 * warps query rows: (16 * warps) // group tokens times the group's heads.
    """
    group = nh // kv_heads
    tokens = attn_max_group(warps) // group
    mod = module("prefill_attn", HEAD_DIM=hd, GROUP=group, WARPS=warps, KV_TILE=ATTN_KV_TILE)
    fn = mod.function("prefill_attn", "iiPPPPi")
    launch = fn.prepare((math.ceil(chunk / tokens), kv_heads), warps * 32, [0, 0, q, k_cache, v_cache, out, max_ctx],
                        smem=attn_smem(hd))
    return ChunkLaunch(launch)


def gemm_rows(t: int, chunk: int) -> int:
    """Rows the prefill's GEMMs compute for a chunk of t tokens: t rounded up to a power of two below 64,
    else to a multiple of 64 (at most chunk). cuBLAS sets up a new problem shape on first use, which
    costs a first request tens of milliseconds; with these few shapes, all warmed at load, none is new.
    The extra rows hold whatever earlier chunks left there and feed only their own output rows."""
    b = 1 << max(0, t - 1).bit_length() if t <= 64 else -(-t // 64) * 64
    return min(b, chunk)


def gemm_buckets(chunk: int) -> list[int]:
    """Every value gemm_rows(t, chunk) takes, ascending."""
    return sorted({gemm_rows(t, chunk) for t in range(1, chunk + 1)})


class Gemm:
    """y[T, n] = x[T, k] W[n, k]^T (or y += with accumulate) on tensor cores through cuBLAS.

    W and x are bf16 bits (uint16), y is fp32; accumulation is fp32. Call inside `with stream:`
    (CuPy points its cuBLAS handle at the current stream on every call).
    """

    def __init__(self, w, x, y, n: int, k: int, accumulate: bool = False):
        from cupy_backends.cuda.libs import cublas

        self._gemm_ex = cublas.gemmEx
        self.n, self.k = n, k
        self.w, self.x, self.y = device_pointer(w), device_pointer(x), device_pointer(y)
        self.alpha, self.beta = _ONE.ctypes.data, (_ONE if accumulate else _ZERO).ctypes.data

    def __call__(self, handle: int, t: int):
        # column-major view: y^T [n, T] = op(W)[n, k] x^T [k, T], W stored as [k, n] with ld k
        self._gemm_ex(handle, CUBLAS_OP_T, CUBLAS_OP_N, self.n, t, self.k, self.alpha, self.w, CUDA_R_16BF, self.k,
                      self.x, CUDA_R_16BF, self.k, self.beta, self.y, CUDA_R_32F, self.n, CUBLAS_COMPUTE_32F,
                      CUBLAS_GEMM_DEFAULT)


def cublas_handle(stream) -> int:
    """CuPy's cuBLAS handle of the current device, bound to `stream` with host scalars (alpha, beta)."""
    import cupy
    from cupy_backends.cuda.libs import cublas

    handle = cupy.cuda.device.get_cublas_handle()
    cublas.setStream(handle, stream.ptr)
    cublas.setPointerMode(handle, CUBLAS_POINTER_MODE_HOST)
    return handle


DEQUANT_THREADS = 128  # threads per dequant_rows block (its THREADS)


def dequant_items(fmt: str, items: int) -> int:
    """Chunks per dequant_rows thread for `items` 32-weight chunks' worth (Q8_0 chunks hold 16, Q2_K 64)."""
    from kernels.quant_layout import fmt_of

    return max(1, items * 32 // fmt_of(fmt).chunk)


def dequant_rows(w, out, r0: int, rows: int, *, items: int = 1, stage: bool = True) -> Launch:
    """out [rows, cols] bf16 bits = rows r0..r0+rows-1 of a QuantWeight, dequantized and rounded to bf16.

    items: 32-weight chunks per thread; stage: stores through shared memory (unit-stride 16 bytes a
    lane: 86% of the copy bandwidth on an H200 for Q4_K, where the plain 64-byte-stride stores reach 47%).
    """
    from kernels.quant_layout import fmt_of

    f = fmt_of(w.fmt)
    chunks = rows * (w.cols // f.chunk)
    if not 0 <= r0 < r0 + rows <= w.rows or chunks >= 2**31:
        raise ValueError(f"rows {r0}..{r0 + rows} of a {w.rows}-row matrix")
    per = dequant_items(f.name, items)
    mod = module("dequant", FORMAT=f.name.upper(), K=w.cols, ITEMS=per, STAGE=int(stage), THREADS=DEQUANT_THREADS)
    src = device_pointer(w.data) + r0 * w.row_bytes
    return mod.function("dequant_rows", "PPi").prepare(math.ceil(chunks / (per * DEQUANT_THREADS)), DEQUANT_THREADS,
                                                       [src, out, rows])
