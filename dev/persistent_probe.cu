// A persistent kernel that runs a model shape's layer GEMVs as phases with a grid barrier between
// them: what a decode step of one launch would pay per phase, against five kernels per layer today.
// Phases are bf16 GEMVs y = W x (x read from L2, rows strided over every warp of the grid); an empty
// phase (rows = 0) stands in for attention. PREFETCH: each warp loads its first row of the next phase
// into registers before the barrier, so the weights stream in while the grid waits.
#include "common.cuh"

struct Phase {
    const uint4* w;  // [rows, k8] 16-byte chunks of 8 bf16
    const float* x;  // [k8 * 8]
    float* y;        // [rows]
    int rows, k8;
};

#ifndef WARPS
#define WARPS 16
#endif
#ifndef CPL
#define CPL 8  // chunks per lane held at once
#endif

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// bar[0]: arrivals of this barrier; bar[1]: generation, bumped by the last block to arrive
__device__ __forceinline__ void grid_barrier(unsigned* bar, unsigned& gen) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        const unsigned arrived = atomicAdd(&bar[0], 1u);
        if (arrived == gridDim.x - 1) {
            bar[0] = 0;
            __threadfence();
            atomicAdd(&bar[1], 1u);
        } else {
            while (ld_acquire(&bar[1]) == gen) {
            }
        }
    }
    ++gen;
    __syncthreads();
}

__device__ __forceinline__ void load_row(const Phase& ph, int r, int c0, uint4 (&a)[CPL]) {
    const int lane = threadIdx.x & 31;
    const uint4* wr = ph.w + (size_t)r * ph.k8;
#pragma unroll
    for (int u = 0; u < CPL; ++u) {
        const int c = c0 + u * 32 + lane;
        a[u] = c < ph.k8 && r < ph.rows ? ld_early(wr + c) : make_uint4(0, 0, 0, 0);
    }
}

__device__ __forceinline__ float dot_part(const Phase& ph, int c0, const uint4 (&a)[CPL]) {
    const int lane = threadIdx.x & 31;
    float acc = 0.f;
#pragma unroll
    for (int u = 0; u < CPL; ++u) {
        const int c = c0 + u * 32 + lane;
        if (c >= ph.k8) break;
        const float4* x4 = reinterpret_cast<const float4*>(ph.x) + 2 * c;
        const float4 p = __ldcg(x4), q = __ldcg(x4 + 1);
        acc = fmaf(bf_lo(a[u].x), p.x, fmaf(bf_hi(a[u].x), p.y, fmaf(bf_lo(a[u].y), p.z, fmaf(bf_hi(a[u].y), p.w, acc))));
        acc = fmaf(bf_lo(a[u].z), q.x, fmaf(bf_hi(a[u].z), q.y, fmaf(bf_lo(a[u].w), q.z, fmaf(bf_hi(a[u].w), q.w, acc))));
    }
    return acc;
}

// BARRIER 2: one monotonic 64-bit counter, each block adds 1 with release semantics (no reply) and polls
// it with acquire loads until every block of this barrier has arrived. The launch's base is the counter at
// the start rounded down to a multiple of the launch's total arrivals (fewer than a barrier's arrivals can
// precede any block's first read).
__device__ __forceinline__ unsigned long long ld_acquire64(const unsigned long long* p) {
    unsigned long long v;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void grid_barrier2(unsigned long long* ctr, unsigned long long& target) {
    __syncthreads();
    target += gridDim.x;
    if (threadIdx.x == 0) {
        asm volatile("red.release.gpu.global.add.u64 [%0], 1;" :: "l"(ctr) : "memory");
        while (ld_acquire64(ctr) < target) {
        }
    }
    __syncthreads();
}

#ifndef BARRIER
#define BARRIER 1
#endif

extern "C" __global__ void __launch_bounds__(WARPS * 32, 1)
persist(const Phase* __restrict__ phases, int nphases, unsigned* bar, int prefetch, int barriers)
{
    const int lane = threadIdx.x & 31;
    const int gw = blockIdx.x * WARPS + (threadIdx.x >> 5), nw = gridDim.x * WARPS;
    unsigned gen = 0;
    if (threadIdx.x == 0) gen = *(volatile unsigned*)&bar[1];
    unsigned long long* ctr = reinterpret_cast<unsigned long long*>(bar + 2);
    unsigned long long target = 0;
    if (BARRIER == 2) {
        const unsigned long long per = (unsigned long long)gridDim.x * nphases;
        target = *(volatile unsigned long long*)ctr / per * per;
    }
    uint4 a[CPL];
    bool have = false;  // a holds this warp's first row of the phase, chunks [0, 32 CPL)
    for (int p = 0; p < nphases; ++p) {
        const Phase ph = phases[p];
        for (int r = gw; r < ph.rows; r += nw) {
            float acc = 0.f;
            for (int c0 = 0; c0 < ph.k8; c0 += 32 * CPL) {
                if (!(have && c0 == 0)) load_row(ph, r, c0, a);
                acc += dot_part(ph, c0, a);
            }
            have = false;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
            if (lane == 0) ph.y[r] = acc * (1.0f / 64.0f);
        }
        if (prefetch && p + 1 < nphases) {
            const Phase nx = phases[p + 1];
            if (gw < nx.rows) {
                load_row(nx, gw, 0, a);
                have = true;
            }
        }
        if (barriers && BARRIER == 1) grid_barrier(bar, gen);
        if (barriers && BARRIER == 2) grid_barrier2(ctr, target);
    }
}
