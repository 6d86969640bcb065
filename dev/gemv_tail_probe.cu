// dev/gemv_tail_probe.py: kernels/gemv.cu's bf16 GEMVs, built with the step's own defines, each block
// also writing its start and end (%globaltimer, ns) to times[2 * block], times[2 * block + 1] (zero before).
#define FORMAT Bf16
#include "gemv_formats.cuh"

typedef FORMAT Fmt;

#include "gemv_core.cuh"

__device__ __forceinline__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

#if EPILOGUE != EPI_ROPE
extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS)
gemv_probe(const unsigned char* __restrict__ w, const float* __restrict__ x, const float* __restrict__ gamma,
           const float* __restrict__ bias, float* __restrict__ y, int n_out, float eps,
           unsigned long long* __restrict__ amax, unsigned long long* __restrict__ times)
{
    if (threadIdx.x == 0) times[2 * blockIdx.x] = now_ns();
    RowEpilogue epi{bias, y, amax, 0ull, n_out, Fmt::ROW_BYTES};
    stream_rows(w, x, gamma, eps, epi);
    if ((threadIdx.x & 31) == 0) atomicMax(times + 2 * blockIdx.x + 1, now_ns());  // the block's last warp
}
#else
extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS)
gemv_rope_probe(const unsigned char* __restrict__ w, const float* __restrict__ x, const float* __restrict__ gamma,
                const float* __restrict__ bias, float* __restrict__ y, int n_pairs, float eps,
                const DecodeState* __restrict__ st, const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                bf16* __restrict__ k_cache, bf16* __restrict__ v_cache, int nh, int nkv, int max_ctx, int head0,
                unsigned long long* __restrict__ times)
{
    if (threadIdx.x == 0) times[2 * blockIdx.x] = now_ns();
    RopeEpilogue epi{bias, y, st, cos_t, sin_t, k_cache, v_cache, n_pairs, nh, nkv, max_ctx, head0, 0,
                     Fmt::ROW_BYTES};
    stream_rows(w, x, gamma, eps, epi);
    if ((threadIdx.x & 31) == 0) atomicMax(times + 2 * blockIdx.x + 1, now_ns());  // the block's last warp
}
#endif
