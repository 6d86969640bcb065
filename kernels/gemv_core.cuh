#pragma once
// y = W x for one token, shared by every weight format: a warp streams the rows of one unit (ROWS
// rows that share each x load) chunk by chunk, 16-byte weight loads, fp32 accumulation, and hands
// the unit's dot products to the epilogue (gemv_epilogue.cuh). `Fmt` (gemv_formats.cuh) says what a
// chunk is, how to load it and how to dot it with x.
// NORM fuses the preceding RMSNorm: x is scaled by gamma where it is read, its squares summed on
// the way, and the dot products scaled by 1/rms at the end. X_SMEM: each block first copies x
// (times gamma) into shared memory, one padded row of float4s per chunk so that the lanes' reads of
// consecutive chunks hit distinct banks; read straight from global memory, a lane's chunk of 32
// 4-bit weights puts the lanes' x loads 128 bytes apart, 32 cache lines per load. SPLIT_K warps share a unit, each taking every SPLIT_K-th
// 32-chunk segment. A block takes several units per warp group, striding by the grid: a grid of
// about one block per resident slot keeps every warp streaming from start to end. Loads run one
// batch ahead of the FMAs, across unit boundaries, so each warp keeps weights in flight through
// every reduction and epilogue. The first batch is issued before waiting on the previous kernel
// (PDL).
#include "gemv_epilogue.cuh"
#include "gemv_formats.cuh"

#ifndef WARPS
#define WARPS 8
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 2
#endif
#ifndef SPLIT_K
#define SPLIT_K 1
#endif
#ifndef NORM
#define NORM 0
#endif
#ifndef X_SMEM
#define X_SMEM 0
#endif

constexpr int GROUPS = WARPS / SPLIT_K;  // units a block streams at once
constexpr int CHUNKS = Fmt::CHUNKS;
constexpr int ITERS = (CHUNKS + 32 * SPLIT_K - 1) / (32 * SPLIT_K);

// loads per batch: a divisor of ITERS when one is close to the cap, so no batch is ragged
constexpr int pick_unroll(int iters, int cap) {
    if (iters <= cap) return iters;
    for (int u = cap; 2 * u > cap; --u)
        if (iters % u == 0) return u;
    return cap;
}
#ifndef UNROLL
#define UNROLL (32 / (ROWS * Fmt::REGS) > 1 ? 32 / (ROWS * Fmt::REGS) : 1)
#endif
constexpr int BATCH = pick_unroll(ITERS, UNROLL);
constexpr int BATCHES = (ITERS + BATCH - 1) / BATCH;
constexpr bool RAGGED = CHUNKS % (32 * SPLIT_K) != 0 || ITERS % BATCH != 0;

static_assert(WARPS % SPLIT_K == 0, "SPLIT_K warps share a unit");

typedef typename Fmt::Chunk Chunk;
constexpr int X_ROW = Fmt::W / 4;  // float4s of x per chunk

// x by (chunk, float4 of the chunk): from shared memory (X_SMEM, gamma already applied) or from
// global memory, with NORM scaled by gamma and its squares added to ss
struct XLoader {
    const float4* x4;
    const float4* g4;
    const float4* xs;
    float ss;
    __device__ __forceinline__ float4 get(int k, int j) {
        if (X_SMEM) return xs[k * (X_ROW + 1) + j];
        float4 v = __ldg(x4 + k * X_ROW + j);
        if (NORM) {
            ss = fmaf(v.x, v.x, fmaf(v.y, v.y, fmaf(v.z, v.z, fmaf(v.w, v.w, ss))));
            v = mul4(v, __ldg(g4 + k * X_ROW + j));
        }
        return v;
    }
};

// X_SMEM: x (times gamma) into xs, padded per chunk; returns 1/rms of x with NORM (else 1)
__device__ __forceinline__ float stage_x(const float4* __restrict__ x4, const float4* __restrict__ g4, float eps,
                                         float4* xs) {
    __shared__ float part[WARPS];
    float ss = 0.f;
#pragma unroll 4
    for (int f = threadIdx.x; f < K / 4; f += WARPS * 32) {
        float4 v = __ldg(x4 + f);
        if (NORM) {
            ss = fmaf(v.x, v.x, fmaf(v.y, v.y, fmaf(v.z, v.z, fmaf(v.w, v.w, ss))));
            v = mul4(v, __ldg(g4 + f));
        }
        xs[f + f / X_ROW] = v;
    }
    if (NORM) {
        ss = warp_sum(ss);
        if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
    }
    __syncthreads();
    if (!NORM) return 1.0f;
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) total += part[w];
    return 1.0f / sqrtf(total / (float)K + eps);
}

// batch b of the unit's rows; a dead unit loads nothing
template <bool EARLY>
__device__ __forceinline__ void load_batch(const unsigned char* const (&rp)[ROWS], bool live, int b, int part,
                                           int lane, Chunk (&a)[BATCH][ROWS]) {
#pragma unroll
    for (int u = 0; u < BATCH; ++u) {
        const int k = ((b * BATCH + u) * SPLIT_K + part) * 32 + lane;
        const bool ok = live && (!RAGGED || k < CHUNKS);
#pragma unroll
        for (int j = 0; j < ROWS; ++j) a[u][j] = Fmt::template load<EARLY>(rp[j], k, ok);
    }
}

template <class Epi>
__device__ __forceinline__ void stream_rows(const unsigned char* __restrict__ w, const float* __restrict__ x,
                                            const float* __restrict__ gamma, float eps, Epi& epi) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, grp = warp / SPLIT_K, part = warp % SPLIT_K;
    const int n = epi.units();
    const int stride = gridDim.x * GROUPS;
    __shared__ float red[2][WARPS][ROWS + 1];
    int base = blockIdx.x * GROUPS;
    if (base >= n) {
        pdl_enter();
        return;
    }
    extern __shared__ float4 xs[];
    XLoader xl{reinterpret_cast<const float4*>(x), reinterpret_cast<const float4*>(gamma), xs, 0.f};
    Chunk a[BATCH][ROWS];
    const unsigned char* rp[ROWS];
    {
        const int u = base + grp;
        epi.rows(u < n ? u : 0, w, rp);
        // the first batch of weights streams in while the previous kernel finishes
        load_batch<true>(rp, u < n, 0, part, lane, a);
    }
    pdl_enter();
    const float x_rs = X_SMEM ? stage_x(xl.x4, xl.g4, eps, xs) : 1.0f;
    epi.begin();
#pragma unroll 1
    for (int j = 0; base < n; base += stride, ++j) {
        const int u = base + grp;
        if (SPLIT_K == 1 && u >= n) break;
        float acc[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[r] = 0.f;
        xl.ss = 0.f;
#pragma unroll 1
        for (int b = 0; b < BATCHES; ++b) {
            const bool next_unit = b + 1 == BATCHES;
            const int nu = next_unit ? u + stride : u;
            const unsigned char* np[ROWS];
            epi.rows(nu < n ? nu : 0, w, np);
            Chunk na[BATCH][ROWS];
            load_batch<false>(np, nu < n, next_unit ? 0 : b + 1, part, lane, na);
#pragma unroll
            for (int v = 0; v < BATCH; ++v) {
                const int k = ((b * BATCH + v) * SPLIT_K + part) * 32 + lane;
                if (RAGGED && k >= CHUNKS) continue;
                Fmt::template dot<ROWS>(a[v], xl, k, acc);
            }
#pragma unroll
            for (int v = 0; v < BATCH; ++v)
#pragma unroll
                for (int r = 0; r < ROWS; ++r) a[v][r] = na[v][r];
        }
        float ss = NORM && !X_SMEM ? warp_sum(xl.ss) : 0.f;
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[r] = warp_sum(acc[r]);
        if (SPLIT_K > 1) {
            // two buffers: a warp refills this one only after the next unit's barrier
            float (&rb)[WARPS][ROWS + 1] = red[j & 1];
            if (lane == 0) {
#pragma unroll
                for (int r = 0; r < ROWS; ++r) rb[warp][r] = acc[r];
                rb[warp][ROWS] = ss;
            }
            __syncthreads();
            if (part == 0) {
#pragma unroll
                for (int p = 1; p < SPLIT_K; ++p) {
#pragma unroll
                    for (int r = 0; r < ROWS; ++r) acc[r] += rb[warp + p][r];
                    ss += rb[warp + p][ROWS];
                }
            }
        }
        if (part != 0 || u >= n || lane != 0) continue;
        if (NORM) {
            const float rs = X_SMEM ? x_rs : 1.0f / sqrtf(ss / (float)K + eps);
#pragma unroll
            for (int r = 0; r < ROWS; ++r) acc[r] *= rs;
        }
        epi(u, acc);
    }
    epi.end();
}
