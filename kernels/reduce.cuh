#pragma once
// Block-wide reductions and scans for a block of BLOCK threads (a multiple of 32, at most 1024).
// Every thread gets the result; the order of the sums is fixed, so results are deterministic.
#include "common.cuh"

#define BLOCK_WARPS (BLOCK / 32)

struct Scratch {
    float f[32];
    int i[32];
};

__device__ __forceinline__ float block_sum(float v, Scratch& s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    if (lane == 0) s.f[warp] = v;
    __syncthreads();
    v = warp_sum(lane < BLOCK_WARPS ? s.f[lane] : 0.f);
    __syncthreads();
    return v;
}

__device__ __forceinline__ float block_max(float v, Scratch& s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_max(v);
    if (lane == 0) s.f[warp] = v;
    __syncthreads();
    v = warp_max(lane < BLOCK_WARPS ? s.f[lane] : NEG_INF);
    __syncthreads();
    return v;
}

__device__ __forceinline__ int warp_sum_int(int v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ int block_sum_int(int v, Scratch& s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum_int(v);
    if (lane == 0) s.i[warp] = v;
    __syncthreads();
    v = warp_sum_int(lane < BLOCK_WARPS ? s.i[lane] : 0);
    __syncthreads();
    return v;
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
