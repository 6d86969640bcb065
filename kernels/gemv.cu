// y = W x for one token: one warp per output row, 16-byte weight loads, fp32 accumulation.
// NORM fuses the preceding RMSNorm: each warp reads all of x anyway, so it sums x^2 on the way
// and scales its dot product by 1/rms at the end. EPI: 0 store (+ bias), 1 y += Wx (residual),
// 2 y = silu(gate) * up with gate rows [0, n_out) and up rows [n_out, 2 n_out),
// 3 (gemv_rope) the fused QKV projection: a warp takes rows i and i + HD/2 of one head, rotates
// q and k heads at the state's position into y, and appends k and v as bf16 to the cache.
// NR > 1 (EPI 0): NR consecutive rows per warp. PAIR (EPI 0, 1): rows r and r + n_out / 2 per warp.
// ARGMAX (with EPI 0) also folds the rows into *amax (argmax_key) for the greedy sampler, which
// resets it: one atomic per warp, skipped when the warp's best key is below the current one.
// The first batch of weight loads is issued before waiting on the previous kernel (PDL).
// Except with NR > 1, a block may take several rows per warp group, striding by the grid: a grid of
// about one block per resident slot keeps every warp streaming from start to end.
// budget: gemv=128 gemv_rope=128
// defines: K=4096 EPI=0 NORM=1 BIAS=1
// defines: K=14336 EPI=1 NORM=0 BIAS=0 SPLITK=4
// defines: K=4096 EPI=2 NORM=1 BIAS=0
// defines: K=576 EPI=0 NORM=1 BIAS=0 ARGMAX=1
// defines: K=896 EPI=0 NORM=1 BIAS=0 ARGMAX=1 NR=4 WARPS=4 MINB=4
// defines: K=72 EPI=0 NORM=0 BIAS=1 NR=4
// defines: K=64 EPI=2 NORM=1 BIAS=0
// defines: K=4096 EPI=3 NORM=1 BIAS=0 HD=128 SPLITK=2
// defines: K=4096 EPI=3 NORM=1 BIAS=0 HD=128 SPLITK=2 WARPS=4 MINB=4
// defines: K=14336 EPI=1 NORM=0 BIAS=0 SPLITK=2 WARPS=4 MINB=4
// defines: K=4096 EPI=2 NORM=1 BIAS=0 WARPS=4 MINB=4
// defines: K=4096 EPI=0 NORM=1 BIAS=0 ARGMAX=1 PAIR=1 WARPS=4 MINB=4
// defines: K=4096 EPI=1 NORM=0 BIAS=0 PAIR=1 SPLITK=2 WARPS=4 MINB=4
// defines: K=14336 EPI=1 NORM=0 BIAS=0 PAIR=1 SPLITK=2 WARPS=4 MINB=4
// defines: K=896 EPI=0 NORM=1 BIAS=1 PAIR=1
// defines: K=896 EPI=3 NORM=1 BIAS=1 HD=64
// defines: K=64 EPI=3 NORM=1 BIAS=1 HD=16
#include "common.cuh"

#ifndef WARPS
#define WARPS 8
#endif
#ifndef MINB
#define MINB 2
#endif
#ifndef ARGMAX
#define ARGMAX 0
#endif
#ifndef SPLITK
#define SPLITK 1
#endif
#ifndef HD
#define HD 128
#endif
#ifndef NR
#define NR 1
#endif
#define HALF (HD / 2)
#ifndef PAIR
#define PAIR 0
#endif
#define ROWS (EPI >= 2 || PAIR ? 2 : 1)
#define RPB (WARPS / SPLITK)
#define CHUNKS (K / 8)
#define ITERS ((CHUNKS + 32 * SPLITK - 1) / (32 * SPLITK))
#ifndef UNROLL
#define UNROLL (ROWS == 2 ? 4 : 8)
#endif

// loads per batch: a divisor of ITERS when one is close to UNROLL, so no batch is ragged
constexpr int pick_unroll(int iters, int cap) {
    if (iters <= cap) return iters;
    for (int u = cap; 2 * u > cap; --u)
        if (iters % u == 0) return u;
    return cap;
}
constexpr int U = pick_unroll(ITERS, UNROLL);
constexpr int BATCHES = (ITERS + U - 1) / U;
constexpr bool RAGGED = CHUNKS % (32 * SPLITK) != 0 || ITERS % U != 0;

static_assert(K % 8 == 0, "K must be a multiple of 8");
static_assert(WARPS % SPLITK == 0, "SPLITK warps share a row");
static_assert(EPI != 3 || HD % 2 == 0, "rope pairs need an even head_dim");
static_assert(NR == 1 || (EPI == 0 && SPLITK == 1 && NR <= 32), "several rows per warp: EPI 0, SPLITK 1");

__device__ __forceinline__ float dot8(const uint4 w, const float4 a, const float4 b, float acc) {
    acc = fmaf(bf_lo(w.x), a.x, acc);
    acc = fmaf(bf_hi(w.x), a.y, acc);
    acc = fmaf(bf_lo(w.y), a.z, acc);
    acc = fmaf(bf_hi(w.y), a.w, acc);
    acc = fmaf(bf_lo(w.z), b.x, acc);
    acc = fmaf(bf_hi(w.z), b.y, acc);
    acc = fmaf(bf_lo(w.w), b.z, acc);
    acc = fmaf(bf_hi(w.w), b.w, acc);
    return acc;
}

__device__ __forceinline__ float4 mul4(float4 a, float4 b) {
    return make_float4(a.x * b.x, a.y * b.y, a.z * b.z, a.w * b.w);
}

// x[8k .. 8k+8) into xa, xb; with NORM, their squares added to ss and the values scaled by gamma
__device__ __forceinline__ void load_x8(const float4* __restrict__ x4, const float4* __restrict__ g4, int k,
                                        float4& xa, float4& xb, float& ss) {
    xa = __ldg(x4 + 2 * k);
    xb = __ldg(x4 + 2 * k + 1);
    if (NORM) {
        ss = fmaf(xa.x, xa.x, fmaf(xa.y, xa.y, fmaf(xa.z, xa.z, fmaf(xa.w, xa.w, ss))));
        ss = fmaf(xb.x, xb.x, fmaf(xb.y, xb.y, fmaf(xb.z, xb.z, fmaf(xb.w, xb.w, ss))));
        xa = mul4(xa, __ldg(g4 + 2 * k));
        xb = mul4(xb, __ldg(g4 + 2 * k + 1));
    }
}

// batch b of rows w0 (and w1 = w0 + off1 when ROWS == 2); a dead row loads nothing (zeros)
template <bool EARLY>
__device__ __forceinline__ void load_batch(const uint4* __restrict__ w0, size_t off1, bool live, int b, int part,
                                           int lane, uint4 (&a)[U], uint4 (&c)[U]) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int k = ((b * U + u) * SPLITK + part) * 32 + lane;
        const bool ok = live && (!RAGGED || k < CHUNKS);
        a[u] = ok ? (EARLY ? ld_early(w0 + k) : ld_stream(w0 + k)) : make_uint4(0, 0, 0, 0);
        if (ROWS == 2) c[u] = ok ? (EARLY ? ld_early(w0 + off1 + k) : ld_stream(w0 + off1 + k)) : make_uint4(0, 0, 0, 0);
    }
}

__device__ __forceinline__ void fma_batch(const float4* __restrict__ x4, const float4* __restrict__ g4, int b,
                                          int part, int lane, const uint4 (&a)[U], const uint4 (&c)[U],
                                          float& acc0, float& acc1, float& ss) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int k = ((b * U + u) * SPLITK + part) * 32 + lane;
        if (RAGGED && k >= CHUNKS) continue;
        float4 xa, xb;
        load_x8(x4, g4, k, xa, xb, ss);
        acc0 = dot8(a[u], xa, xb, acc0);
        if (ROWS == 2) acc1 = dot8(c[u], xa, xb, acc1);
    }
}

// Rows r = (blockIdx.x + j gridDim.x) RPB + warp / SPLITK for j = 0, 1, ... while the block's first
// row is below n: each row (w0 = row_of(r), w1 = w0 + off1) times x, RMS-normalised with gamma when
// NORM, handed to epi(r, acc0, acc1) by lane 0 of the group's first warp. SPLITK warps share a row,
// each taking every SPLITK-th 512-byte segment. Loads run one batch of U ahead of the FMAs, across
// row boundaries, so each warp keeps weights in flight through every reduction and epilogue.
// epi.begin() runs once, after the PDL wait.
template <typename RowOf, typename Epi>
__device__ __forceinline__ void stream_rows(int n, size_t off1, const float* __restrict__ x,
                                            const float* __restrict__ gamma, float eps, RowOf row_of, Epi& epi) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, grp = warp / SPLITK, part = warp % SPLITK;
    const float4* x4 = reinterpret_cast<const float4*>(x);
    const float4* g4 = reinterpret_cast<const float4*>(gamma);
    const int stride = gridDim.x * RPB;
    __shared__ float red[2][WARPS][3];
    int base = blockIdx.x * RPB;
    if (base >= n) {
        pdl_enter();
        return;
    }
    uint4 a[U], c[U];
    {
        const int r = base + grp;
        // the first batch of weights streams in while the previous kernel finishes
        load_batch<true>(row_of(r < n ? r : 0), off1, r < n, 0, part, lane, a, c);
    }
    pdl_enter();
    epi.begin();
#pragma unroll 1
    for (int j = 0; base < n; base += stride, ++j) {
        const int r = base + grp;
        if (SPLITK == 1 && r >= n) break;
        float acc0 = 0.f, acc1 = 0.f, ss = 0.f;
#pragma unroll 1
        for (int b = 0; b < BATCHES; ++b) {
            const bool next_row = b + 1 == BATCHES;
            const int nr = next_row ? r + stride : r;
            uint4 na[U], nc[U];
            load_batch<false>(row_of(nr < n ? nr : 0), off1, nr < n, next_row ? 0 : b + 1, part, lane, na, nc);
            fma_batch(x4, g4, b, part, lane, a, c, acc0, acc1, ss);
#pragma unroll
            for (int u = 0; u < U; ++u) {
                a[u] = na[u];
                if (ROWS == 2) c[u] = nc[u];
            }
        }
        acc0 = warp_sum(acc0);
        if (ROWS == 2) acc1 = warp_sum(acc1);
        if (NORM) ss = warp_sum(ss);
        if (SPLITK > 1) {
            // two buffers: a warp refills this one only after the next row's barrier
            float (&rb)[WARPS][3] = red[j & 1];
            if (lane == 0) {
                rb[warp][0] = acc0;
                rb[warp][1] = acc1;
                rb[warp][2] = ss;
            }
            __syncthreads();
            if (part == 0) {
#pragma unroll
                for (int p = 1; p < SPLITK; ++p) {
                    acc0 += rb[warp + p][0];
                    acc1 += rb[warp + p][1];
                    ss += rb[warp + p][2];
                }
            }
        }
        if (part != 0 || r >= n || lane != 0) continue;
        if (NORM) {
            const float rs = 1.0f / sqrtf(ss / (float)K + eps);
            acc0 *= rs;
            acc1 *= rs;
        }
        epi(r, acc0, acc1);
    }
    epi.end();
}

#if NR > 1
template <bool EARLY>
__device__ __forceinline__ void load_rows(const uint4* const (&wr)[NR], int b, int lane, uint4 (&a)[NR][U]) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int k = (b * U + u) * 32 + lane;
        const bool ok = !RAGGED || k < CHUNKS;
#pragma unroll
        for (int i = 0; i < NR; ++i)
            a[i][u] = ok ? (EARLY ? ld_early(wr[i] + k) : ld_stream(wr[i] + k)) : make_uint4(0, 0, 0, 0);
    }
}

// EPI 0 with NR consecutive rows per warp (short rows, many of them: the lm_head of a small
// model): x and gamma are read once for all NR rows, and NR rows of loads are in flight
extern "C" __global__ void __launch_bounds__(WARPS * 32, MINB)
gemv(const bf16* __restrict__ w, const float* __restrict__ x, const float* __restrict__ gamma,
     const float* __restrict__ bias, float* __restrict__ y, int n_out, float eps,
     unsigned long long* __restrict__ amax)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int row0 = (blockIdx.x * WARPS + warp) * NR;
    if (row0 >= n_out) return;
    // rows past the end stream the last row and store nothing
    const uint4* wr[NR];
#pragma unroll
    for (int i = 0; i < NR; ++i) wr[i] = reinterpret_cast<const uint4*>(w) + (size_t)min(row0 + i, n_out - 1) * CHUNKS;
    const float4* x4 = reinterpret_cast<const float4*>(x);
    const float4* g4 = reinterpret_cast<const float4*>(gamma);
    float acc[NR], ss = 0.f;
#pragma unroll
    for (int i = 0; i < NR; ++i) acc[i] = 0.f;
#pragma unroll 1
    for (int b = 0; b < BATCHES; ++b) {
        uint4 a[NR][U];
        if (b == 0) {
            load_rows<true>(wr, 0, lane, a);
            pdl_enter();
        } else {
            load_rows<false>(wr, b, lane, a);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int k = (b * U + u) * 32 + lane;
            if (RAGGED && k >= CHUNKS) continue;
            float4 xa, xb;
            load_x8(x4, g4, k, xa, xb, ss);
#pragma unroll
            for (int i = 0; i < NR; ++i) acc[i] = dot8(a[i][u], xa, xb, acc[i]);
        }
    }
    const float r = NORM ? 1.0f / sqrtf(warp_sum(ss) / (float)K + eps) : 1.0f;
    float v = 0.f;
#pragma unroll
    for (int i = 0; i < NR; ++i) {
        const float t = warp_sum(acc[i]) * r;
        if (lane == i) v = t;
    }
    const int row = row0 + lane;
    if (lane >= NR || row >= n_out) return;
    if (BIAS) v += bias[row];
    y[row] = v;
    if (ARGMAX) {
        const unsigned long long key = argmax_key(v, row);
        if (key > *(volatile unsigned long long*)amax) atomicMax(amax, key);
    }
}
#elif EPI != 3
// ARGMAX: each warp keeps the best key of its rows and folds it into *amax once, at the end
struct StoreRow {
    const float* bias;
    float* y;
    unsigned long long* amax;
    unsigned long long best;  // ARGMAX: the best key of this warp's rows so far
    int half;                 // PAIR: the second row of unit r is r + half
    __device__ __forceinline__ void begin() {}
    __device__ __forceinline__ void end() {
        if (ARGMAX && best != 0ull && best > *(volatile unsigned long long*)amax) atomicMax(amax, best);
    }
    __device__ __forceinline__ void one(int row, float acc) {
        const float v = BIAS ? acc + bias[row] : acc;
        if (EPI == 0) y[row] = v;
        if (ARGMAX) best = max(best, argmax_key(v, row));
        if (EPI == 1) y[row] += acc;
    }
    __device__ __forceinline__ void operator()(int row, float acc0, float acc1) {
        if (EPI == 2) {
            y[row] = acc0 / (1.0f + expf(-acc0)) * acc1;
        } else {
            one(row, acc0);
            if (PAIR) one(row + half, acc1);
        }
    }
};

// w: [ROWS * n_out, K] bf16 (EPI 2), [n_out, K] otherwise; x: [K]; gamma: [K] (NORM); bias: [n_out]
// (BIAS); y: [n_out]. PAIR (EPI 0 or 1, n_out even): a warp streams rows r and r + n_out / 2 together,
// so each x (and gamma) value it loads serves two weights.
// MINB caps registers so that ptxas keeps all U loads of a batch in flight
extern "C" __global__ void __launch_bounds__(WARPS * 32, MINB)
gemv(const bf16* __restrict__ w, const float* __restrict__ x, const float* __restrict__ gamma,
     const float* __restrict__ bias, float* __restrict__ y, int n_out, float eps,
     unsigned long long* __restrict__ amax)
{
    static_assert(!PAIR || EPI < 2, "PAIR pairs the rows of EPI 0 or 1");
    const uint4* w4 = reinterpret_cast<const uint4*>(w);
    const int units = PAIR ? n_out / 2 : n_out;
    StoreRow epi{bias, y, amax, 0ull, units};
    stream_rows(units, (size_t)(EPI == 2 || PAIR ? units : n_out) * CHUNKS, x, gamma, eps,
                [&](int r) { return w4 + (size_t)r * CHUNKS; }, epi);
}
#else
struct RopeRow {
    const float* bias;
    float* y;
    const DecodeState* st;
    const float *cos_t, *sin_t;
    bf16 *k_cache, *v_cache;
    int nh, nkv, max_ctx, pos;
    __device__ __forceinline__ void begin() { pos = min(max(st->pos, 0), max_ctx - 1); }
    __device__ __forceinline__ void end() {}
    __device__ __forceinline__ void operator()(int pair, float acc0, float acc1) {
        const int head = pair / HALF, i = pair % HALF;
        const int r0 = head * HD + i;
        float a = BIAS ? acc0 + bias[r0] : acc0;
        float b = BIAS ? acc1 + bias[r0 + HALF] : acc1;
        if (head < nh + nkv) rotate_pair(a, b, cos_t[(size_t)pos * HALF + i], sin_t[(size_t)pos * HALF + i]);
        y[r0] = a;
        y[r0 + HALF] = b;
        if (head >= nh) {
            const bool is_v = head >= nh + nkv;
            const int kvh = head - nh - (is_v ? nkv : 0);
            bf16* dst = (is_v ? v_cache : k_cache) + ((size_t)kvh * max_ctx + pos) * HD + i;
            dst[0] = f2bf(a);
            dst[HALF] = f2bf(b);
        }
    }
};

// w: [(nh + 2 nkv) HD, K] bf16 (q, k, v heads); bias: [(nh + 2 nkv) HD] (BIAS); y: the same, f32;
// cos, sin: [max_ctx, HD/2]; k_cache, v_cache: this layer's [nkv, max_ctx, HD] bf16, row
// min(pos, max_ctx - 1) written; n_pairs = (nh + 2 nkv) HD / 2. Pair p: rows i and i + HD/2 of head
// p / (HD/2), i = p % (HD/2).
extern "C" __global__ void __launch_bounds__(WARPS * 32, MINB)
gemv_rope(const bf16* __restrict__ w, const float* __restrict__ x, const float* __restrict__ gamma,
          const float* __restrict__ bias, float* __restrict__ y, int n_pairs, float eps,
          const DecodeState* __restrict__ st, const float* __restrict__ cos_t, const float* __restrict__ sin_t,
          bf16* __restrict__ k_cache, bf16* __restrict__ v_cache, int nh, int nkv, int max_ctx)
{
    const uint4* w4 = reinterpret_cast<const uint4*>(w);
    RopeRow epi{bias, y, st, cos_t, sin_t, k_cache, v_cache, nh, nkv, max_ctx, 0};
    stream_rows(n_pairs, (size_t)HALF * CHUNKS, x, gamma, eps,
                [&](int p) { return w4 + (size_t)((p / HALF) * HD + p % HALF) * CHUNKS; }, epi);
}
#endif
