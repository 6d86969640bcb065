#pragma once
// The GEMV entry points of one weight format: the file that includes this defines FORMAT (a type
// of gemv_formats.cuh) and KERNEL_SUFFIX (appended to the kernel names).
#include "gemv_formats.cuh"

typedef FORMAT Fmt;

#include "gemv_core.cuh"

#define PASTE_(a, b) a##b
#define PASTE(a, b) PASTE_(a, b)
#define KERNEL_NAME(base) PASTE(base, KERNEL_SUFFIX)

#if EPILOGUE != EPI_ROPE
// w: [rows, K] of the format (2 n_out rows for EPI_SILU: gate, then up); x: [K]; gamma: [K] (NORM);
// bias: [rows] (BIAS); y: [n_out]; amax (ARGMAX): the packed argmax word the sampler resets.
// MIN_BLOCKS caps registers so that ptxas keeps a batch of loads in flight
extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS)
KERNEL_NAME(gemv)(const unsigned char* __restrict__ w, const float* __restrict__ x, const float* __restrict__ gamma,
                  const float* __restrict__ bias, float* __restrict__ y, int n_out, float eps,
                  unsigned long long* __restrict__ amax)
{
    RowEpilogue epi{bias, y, amax, 0ull, n_out, Fmt::ROW_BYTES};
    stream_rows(w, x, gamma, eps, epi);
}
#else
// w: the rows of heads [head0, head0 + n_pairs / (HEAD_DIM / 2)) of the fused q | k | v weights;
// bias, y: [(nh + 2 nkv) HEAD_DIM] f32; cos, sin: [max_ctx, HEAD_DIM / 2]; k_cache, v_cache: this
// layer's [nkv, max_ctx, HEAD_DIM] bf16, row min(pos, max_ctx - 1) written.
extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS)
KERNEL_NAME(gemv_rope)(const unsigned char* __restrict__ w, const float* __restrict__ x,
                       const float* __restrict__ gamma, const float* __restrict__ bias, float* __restrict__ y,
                       int n_pairs, float eps, const DecodeState* __restrict__ st, const float* __restrict__ cos_t,
                       const float* __restrict__ sin_t, bf16* __restrict__ k_cache, bf16* __restrict__ v_cache,
                       int nh, int nkv, int max_ctx, int head0)
{
    RopeEpilogue epi{bias, y, st, cos_t, sin_t, k_cache, v_cache, n_pairs, nh, nkv, max_ctx, head0, 0,
                     Fmt::ROW_BYTES};
    stream_rows(w, x, gamma, eps, epi);
}
#endif
