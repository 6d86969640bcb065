#pragma once
// y = W x for one token, shared by every weight format: a warp streams the rows of one unit (ROWS
// rows that share each x load) chunk by chunk, 16-byte weight loads, fp32 accumulation, and hands
// the unit's dot products to the epilogue (gemv_epilogue.cuh). `Fmt` (gemv_formats.cuh) says what a
// chunk is, how to load it and how to dot it with x.
// NORM fuses the preceding RMSNorm: x is scaled by gamma where it is read, its squares summed on
// the way, and the dot products scaled by 1/rms at the end. X_SMEM: each block first copies x
// (times gamma) into shared memory, one padded row of float4s per chunk so that the lanes' reads of
// consecutive chunks hit distinct banks; read straight from global memory, a lane's chunk of 32
// 4-bit weights puts the lanes' x loads 128 bytes apart, 32 cache lines per load. XQ (block formats):
// x (times gamma) is instead quantized to int8 per 32 values into shared memory, ggml's q8_1, and the
// formats' dotq multiply it by their integer quants with dp4a (4 weights per instruction, a quarter of
// the x bytes); 1/rms still scales the final dot. SPLIT_K warps share a unit, each taking every SPLIT_K-th
// 32-chunk segment. A block takes several units per warp group, striding by the grid: a grid of
// about one block per resident slot keeps every warp streaming from start to end. Loads run one
// batch ahead of the FMAs, across unit boundaries, so each warp keeps weights in flight through
// every reduction and epilogue. The first batch is issued before waiting on the previous kernel
// (PDL). LATE_WAIT: the previous kernel writes nothing this one reads or writes (it is another part of the
// same projection, e.g. a Q4_K_M layer's Q6_K v rows after its Q4_K q and k rows), so this one streams at
// once and waits for it only at its end, which still orders both before the next kernel.
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
#ifndef XQ
#define XQ 0
#endif
#ifndef EARLY_BATCH
#define EARLY_BATCH 1  // the first batch of weights is loaded before the PDL wait
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
        float4 v = ld_x(x4 + k * X_ROW + j);
        if (NORM) {
            ss = fmaf(v.x, v.x, fmaf(v.y, v.y, fmaf(v.z, v.z, fmaf(v.w, v.w, ss))));
            v = mul4(v, __ldg(g4 + k * X_ROW + j));
        }
        return v;
    }
};

// after staging: a barrier (what the threads staged is then visible to all), and with NORM 1/rms of x
// from each thread's partial sum of squares ss (else 1)
__device__ __forceinline__ float rms_inv(float ss, float eps, float* part) {
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

// X_SMEM: x (times gamma) into xs, padded per chunk; returns 1/rms of x with NORM (else 1)
__device__ __forceinline__ float stage_x(const float4* __restrict__ x4, const float4* __restrict__ g4, float eps,
                                         float4* xs) {
    __shared__ float part[WARPS];
    float ss = 0.f;
#pragma unroll 4
    for (int f = threadIdx.x; f < K / 4; f += WARPS * 32) {
        float4 v = ld_x(x4 + f);
        if (NORM) {
            ss = fmaf(v.x, v.x, fmaf(v.y, v.y, fmaf(v.z, v.z, fmaf(v.w, v.w, ss))));
            v = mul4(v, __ldg(g4 + f));
        }
        xs[f + f / X_ROW] = v;
    }
    return rms_inv(ss, eps, part);
}

// XQ: x (times gamma) quantized into shared memory as ggml's q8_1, per block of 32 values: d = amax / 127,
// q = rint(x / d) computed as x * (1 / d) (round half to even; all in fp32 round-to-nearest). Granule g
// (values 16g..16g+15) sits in plane g % G at index g / G, G granules per chunk, so each lane reads its
// chunk's granules at unit stride; meta[b] = (d, the int16 sums of q over the block's two halves).
#if XQ
constexpr int XG = Fmt::W / 16;  // granules per chunk
struct XQLoader {
    const uint4* q;
    const uint2* m;
    __device__ __forceinline__ uint4 granule(int k, int i) const { return q[i * CHUNKS + k]; }
    __device__ __forceinline__ uint2 meta(int b) const { return m[b]; }
    __device__ __forceinline__ uint4 meta2(int k) const { return reinterpret_cast<const uint4*>(m)[k]; }
};

// returns 1/rms of x with NORM (else 1)
__device__ __forceinline__ float stage_xq(const float4* __restrict__ x4, const float4* __restrict__ g4, float eps,
                                          unsigned char* xs) {
    __shared__ float part[WARPS];
    constexpr int N8 = K / 8;  // 8 values per thread and step; 4 lanes per block of 32
    float ss = 0.f;
#pragma unroll 4
    for (int f0 = 0; f0 < N8; f0 += WARPS * 32) {
        const int f = f0 + threadIdx.x;
        const bool ok = f < N8;  // uniform over each 4 lanes of one block
        float4 a = ok ? ld_x(x4 + 2 * f) : make_float4(0.f, 0.f, 0.f, 0.f);
        float4 b = ok ? ld_x(x4 + 2 * f + 1) : make_float4(0.f, 0.f, 0.f, 0.f);
        if (NORM) {
            ss = fmaf(a.x, a.x, fmaf(a.y, a.y, fmaf(a.z, a.z, fmaf(a.w, a.w, ss))));
            ss = fmaf(b.x, b.x, fmaf(b.y, b.y, fmaf(b.z, b.z, fmaf(b.w, b.w, ss))));
            if (ok) {
                a = mul4(a, __ldg(g4 + 2 * f));
                b = mul4(b, __ldg(g4 + 2 * f + 1));
            }
        }
        float amax = fmaxf(fmaxf(fmaxf(fabsf(a.x), fabsf(a.y)), fmaxf(fabsf(a.z), fabsf(a.w))),
                           fmaxf(fmaxf(fabsf(b.x), fabsf(b.y)), fmaxf(fabsf(b.z), fabsf(b.w))));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
        // fmaxf drops a NaN and rint of Inf * 0 is 0: nan is 0 for a finite block and NaN otherwise, and
        // d + nan carries it into every dot product with the block (d itself is unchanged, bit for bit)
        float nan = ((a.x - a.x) + (a.y - a.y)) + ((a.z - a.z) + (a.w - a.w)) + ((b.x - b.x) + (b.y - b.y)) +
                    ((b.z - b.z) + (b.w - b.w));
        nan += __shfl_xor_sync(0xffffffffu, nan, 1);
        nan += __shfl_xor_sync(0xffffffffu, nan, 2);
        const float d = __fdiv_rn(amax, 127.0f) + nan;
        const float id = d > 0.f ? __frcp_rn(d) : 0.f;
        const int q0 = __float2int_rn(a.x * id), q1 = __float2int_rn(a.y * id), q2 = __float2int_rn(a.z * id),
                  q3 = __float2int_rn(a.w * id), q4 = __float2int_rn(b.x * id), q5 = __float2int_rn(b.y * id),
                  q6 = __float2int_rn(b.z * id), q7 = __float2int_rn(b.w * id);
        const unsigned lo = __byte_perm(__byte_perm(q0, q1, 0x0040), __byte_perm(q2, q3, 0x0040), 0x5410);
        const unsigned hi = __byte_perm(__byte_perm(q4, q5, 0x0040), __byte_perm(q6, q7, 0x0040), 0x5410);
        int sq = ((q0 + q1) + (q2 + q3)) + ((q4 + q5) + (q6 + q7));
        sq += __shfl_xor_sync(0xffffffffu, sq, 1);  // the sum over this 16-value granule
        const int other = __shfl_xor_sync(0xffffffffu, sq, 2);
        if (ok) {
            const int g = f >> 1;
            reinterpret_cast<uint2*>(xs)[2 * ((g % XG) * CHUNKS + g / XG) + (f & 1)] = make_uint2(lo, hi);
            if ((f & 3) == 0)
                reinterpret_cast<uint2*>(xs + K)[f >> 2] =
                    make_uint2(__float_as_uint(d), ((unsigned)sq & 0xffffu) | ((unsigned)other << 16));
        }
    }
    return rms_inv(ss, eps, part);
}
#endif

// batch b of the unit's rows; a dead unit loads nothing. Unsplit whole batches: a row's chunks of the
// batch are one lane's consecutive passes, whose side bytes a format may load together (load_run)
template <bool EARLY>
__device__ __forceinline__ void load_batch(const unsigned char* const (&rp)[ROWS], bool live, int b, int part,
                                           int lane, Chunk (&a)[BATCH][ROWS]) {
    if constexpr (SPLIT_K == 1 && !RAGGED) {
#pragma unroll
        for (int j = 0; j < ROWS; ++j) {
            Chunk c[BATCH];
            Fmt::template load_run<EARLY, BATCH>(rp[j], b * BATCH, lane, live, c);
#pragma unroll
            for (int u = 0; u < BATCH; ++u) a[u][j] = c[u];
        }
        return;
    }
#pragma unroll
    for (int u = 0; u < BATCH; ++u) {
        const int pass = (b * BATCH + u) * SPLIT_K + part;
        const bool ok = live && (!RAGGED || pass * 32 + lane < CHUNKS);
#pragma unroll
        for (int j = 0; j < ROWS; ++j) a[u][j] = Fmt::template load_at<EARLY>(rp[j], pass, lane, ok);
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
#if XQ
    XQLoader xl{reinterpret_cast<const uint4*>(xs), reinterpret_cast<const uint2*>(reinterpret_cast<const unsigned char*>(xs) + K)};
#else
    XLoader xl{reinterpret_cast<const float4*>(x), reinterpret_cast<const float4*>(gamma), xs, 0.f};
#endif
    Chunk a[BATCH][ROWS];
    const unsigned char* rp[ROWS];
    const bool first_live = base + grp < n;
    epi.rows(first_live ? base + grp : 0, w, rp);
    // the first batch of weights streams in while the previous kernel finishes (EARLY_BATCH), else after it
    if (EARLY_BATCH) load_batch<true>(rp, first_live, 0, part, lane, a);
    if (LATE_WAIT)
        pdl_launch();
    else
        pdl_enter();
    if (!EARLY_BATCH) load_batch<false>(rp, first_live, 0, part, lane, a);
#if XQ
    const float x_rs = stage_xq(reinterpret_cast<const float4*>(x), reinterpret_cast<const float4*>(gamma), eps,
                                reinterpret_cast<unsigned char*>(xs));
#else
    const float x_rs = X_SMEM ? stage_x(xl.x4, xl.g4, eps, xs) : 1.0f;
#endif
    epi.begin();
#pragma unroll 1
    for (int j = 0; base < n; base += stride, ++j) {
        const int u = base + grp;
        if (SPLIT_K == 1 && u >= n) break;
        float acc[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[r] = 0.f;
#if !XQ
        xl.ss = 0.f;
#endif
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
#if XQ
                Fmt::template dotq<ROWS>(a[v], xl, k, acc);
#else
                Fmt::template dot<ROWS>(a[v], xl, k, acc);
#endif
            }
#pragma unroll
            for (int v = 0; v < BATCH; ++v)
#pragma unroll
                for (int r = 0; r < ROWS; ++r) a[v][r] = na[v][r];
        }
#if XQ
        float ss = 0.f;
#else
        float ss = NORM && !X_SMEM ? warp_sum(xl.ss) : 0.f;
#endif
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
            const float rs = X_SMEM || XQ ? x_rs : 1.0f / sqrtf(ss / (float)K + eps);
#pragma unroll
            for (int r = 0; r < ROWS; ++r) acc[r] *= rs;
        }
        epi(u, acc);
    }
    epi.end();
    if (LATE_WAIT) pdl_wait();  // this grid ends after the previous one: the next kernel may read both
}
