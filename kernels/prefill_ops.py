"""Launch builders for batched prefill: per-token row kernels, causal flash attention, cuBLAS GEMMs.

Every prefill kernel takes (pos0, T) as its first two arguments and has a grid sized for the whole
chunk, so a ChunkLaunch is built once and only those two values change from chunk to chunk.
"""

from __future__ import annotations

import math

import numpy as np

from kernels.launch import Launch
from kernels.ops import LOG2E, module, sm_count

ROW_WARPS = 4
EMBED_BLOCK = 128
SILU_BLOCK = 256
ATTN_WARPS, ATTN_BN = 4, 64

# cuBLAS enums (cublas_api.h, library_types.h)
OP_N, OP_T = 0, 1
R_32F, R_16BF = 0, 14
COMPUTE_32F = 68
GEMM_DEFAULT = -1
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


def embed_rows(table, prompt, x, *, chunk: int, hidden: int, vocab: int) -> ChunkLaunch:
    """x[t] = table[prompt[pos0 + t]] as fp32."""
    grid = (chunk, math.ceil(hidden // 8 / EMBED_BLOCK))
    fn = module("prefill_rope", HD=16, QK_NORM=0, BIAS=0).function("embed_rows", "iiPPPii")
    return ChunkLaunch(fn.prepare(grid, EMBED_BLOCK, [0, 0, table, prompt, x, vocab, hidden]))


def rms_rows(x, gamma, out, *, chunk: int, hidden: int, eps: float) -> ChunkLaunch:
    """out[t] = bf16(rmsnorm(x[t]) * gamma)."""
    fn = module("prefill_rope", HD=16, QK_NORM=0, BIAS=0).function("rms_rows", "iiPPPif")
    return ChunkLaunch(fn.prepare(math.ceil(chunk / ROW_WARPS), ROW_WARPS * 32, [0, 0, x, gamma, out, hidden, eps]))


def rope_rows(qkv, bias, q_norm, k_norm, cos, sin, q_out, k_cache, v_cache, *, chunk: int, nh: int, nkv: int,
              hd: int, max_ctx: int, eps: float) -> ChunkLaunch:
    """Bias, q/k RMSNorm and RoPE of each token; q to q_out (scaled for base-2 softmax), k/v into the cache."""
    mod = module("prefill_rope", HD=hd, QK_NORM=int(q_norm is not None), BIAS=int(bias is not None))
    fn = mod.function("rope_rows", "iiPPPPPPPPPiiiff")
    grid = (chunk, math.ceil((nh + nkv) / ROW_WARPS))
    qscale = hd**-0.5 * LOG2E
    args = [0, 0, qkv, bias, q_norm, k_norm, cos, sin, q_out, k_cache, v_cache, nh, nkv, max_ctx, eps, qscale]
    return ChunkLaunch(fn.prepare(grid, ROW_WARPS * 32, args))


def silu_rows(gu, act, *, chunk: int, inter: int) -> ChunkLaunch:
    """act[t] = bf16(silu(gate[t]) * up[t]) with gu[t] = gate | up."""
    fn = module("prefill_rope", HD=16, QK_NORM=0, BIAS=0).function("silu_rows", "iiPPi")
    grid = max(1, min(math.ceil(chunk * inter / 4 / SILU_BLOCK), 8 * sm_count()))
    return ChunkLaunch(fn.prepare(grid, SILU_BLOCK, [0, 0, gu, act, inter]))


def attn_smem(hd: int) -> int:
    return 2 * 2 * ATTN_BN * (hd + 8) * 2


def prefill_attn(q, k_cache, v_cache, out, *, chunk: int, nh: int, nkv: int, hd: int, max_ctx: int,
                 warps: int = ATTN_WARPS) -> ChunkLaunch:
    """Causal attention of the chunk's queries over cache rows [0, pos0 + t] -> out [chunk, nh * hd] bf16.

    A block takes 16 * warps query rows: (16 * warps) // group tokens times the group's heads.
    """
    g = nh // nkv
    tok = 16 * warps // g
    fn = module("prefill_attn", HD=hd, G=g, WARPS=warps).function("prefill_attn", "iiPPPPi")
    launch = fn.prepare((math.ceil(chunk / tok), nkv), warps * 32, [0, 0, q, k_cache, v_cache, out, max_ctx],
                        smem=attn_smem(hd))
    return ChunkLaunch(launch)


class Gemm:
    """y[T, n] = x[T, k] W[n, k]^T (or y += with accumulate) on tensor cores through cuBLAS.

    W and x are bf16 bits (uint16), y is fp32; accumulation is fp32. Call inside `with stream:`
    (CuPy points its cuBLAS handle at the current stream on every call).
    """

    def __init__(self, w, x, y, n: int, k: int, accumulate: bool = False):
        from cupy_backends.cuda.libs import cublas

        from kernels.launch import device_pointer

        self._gemm_ex = cublas.gemmEx
        self.n, self.k = n, k
        self.w, self.x, self.y = device_pointer(w), device_pointer(x), device_pointer(y)
        self.alpha, self.beta = _ONE.ctypes.data, (_ONE if accumulate else _ZERO).ctypes.data

    def __call__(self, handle: int, t: int):
        # column-major view: y^T [n, T] = op(W)[n, k] x^T [k, T], W stored as [k, n] with ld k
        self._gemm_ex(handle, OP_T, OP_N, self.n, t, self.k, self.alpha, self.w, R_16BF, self.k,
                      self.x, R_16BF, self.k, self.beta, self.y, R_32F, self.n, COMPUTE_32F, GEMM_DEFAULT)


def cublas_handle(stream) -> int:
    """CuPy's cuBLAS handle of the current device, bound to `stream` with host scalars."""
    import cupy
    from cupy_backends.cuda.libs import cublas

    handle = cupy.cuda.device.get_cublas_handle()
    cublas.setStream(handle, stream.ptr)
    cublas.setPointerMode(handle, 0)
    return handle
