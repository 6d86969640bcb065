#pragma once
// Block-wide reductions and scans for a block of BLOCK threads (a multiple of 32, at most 1024).
// Every thread gets the result; the order of the sums is fixed, so results are deterministic.
#include "common.cuh"

#define BLOCK_WARPS (BLOCK / 32)

struct Scratch {
    float f[32];
    int i[32];
};

// WARP_OP folds a warp; lanes past the last warp's partial read `identity`
template <typename T, T (*WARP_OP)(T)>
__device__ __forceinline__ T block_reduce(T v, T (&partial)[32], T identity) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = WARP_OP(v);
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = WARP_OP(lane < BLOCK_WARPS ? partial[lane] : identity);
    __syncthreads();
    return v;
}

__device__ __forceinline__ float block_sum(float v, Scratch& s) {
    return block_reduce<float, warp_sum>(v, s.f, 0.f);
}

__device__ __forceinline__ float block_max(float v, Scratch& s) {
    return block_reduce<float, warp_max>(v, s.f, NEG_INF);
}

__device__ __forceinline__ int warp_sum_int(int v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ int block_sum_int(int v, Scratch& s) {
    return block_reduce<int, warp_sum_int>(v, s.i, 0);
}

// (value, index) with the larger value winning, the lower index on ties
__device__ __forceinline__ void better(float& v, int& i, float v2, int i2) {
    if (v2 > v || (v2 == v && i2 < i)) {
        v = v2;
        i = i2;
    }
}

__device__ __forceinline__ int block_argmax(float v, int i, Scratch& s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) better(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
    if (lane == 0) {
        s.f[warp] = v;
        s.i[warp] = i;
    }
    __syncthreads();
    v = lane < BLOCK_WARPS ? s.f[lane] : NEG_INF;
    i = lane < BLOCK_WARPS ? s.i[lane] : 0x7fffffff;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) better(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
    __syncthreads();
    return i;
}

// exclusive prefix sum of v over the block; *total gets the sum
__device__ __forceinline__ int block_scan(int v, int* total, Scratch& s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    if (lane == 31) s.i[warp] = x;
    __syncthreads();
    int w = lane < BLOCK_WARPS ? s.i[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, w, o);
        if (lane >= o) w += y;
    }
    const int prev = __shfl_sync(0xffffffffu, w, (warp + 31) & 31);
    const int before = warp > 0 ? prev : 0;
    *total = __shfl_sync(0xffffffffu, w, 31);
    __syncthreads();
    return before + x - v;
}
