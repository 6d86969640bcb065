// dev/gemv_tickets_ab.py: kernels/gemv.cu's bf16 GEMVs with the last TAIL passes over the grid handed out from a
// counter instead of striding by it, so that the groups that finish their passes first take the units left and
// the grid ends together. The step's own defines, one more argument: `tickets`, a uint64 per launch, zero before
// its first launch and never reset.
// The agents that draw tickets: each warp where a unit is one warp's (SPLIT_K 1); each block where the warps of a
// unit meet at a barrier (SPLIT_K > 1), a ticket then being the block's GROUPS units. Every agent stops at its first
// ticket past the last unit, so a launch draws exactly `period` = units left + agents tickets, and the counter
// starts every launch at a multiple of it: ticket t is unit t % period of this launch. Each draw is made two
// passes ahead, so that its round trip hides behind a whole pass: a warp resolves it at the start of the pass
// before the one it is for, a block's thread 0 leaves it in shared memory before that pass's barrier. Matrices of
// fewer than TAIL + 2 full passes keep the stride.
#define FORMAT Bf16
#include "gemv_formats.cuh"

typedef FORMAT Fmt;

#include "gemv_core.cuh"

#ifndef TAIL
#define TAIL 1
#endif

static_assert(!XQ, "bf16 only: x is fp32");

// the first unit of the draw t (warps draw: the unit; blocks draw: the block's pass), or -1 past the last; from
// the static passes, recomputed here rather than held in registers through the unit
__device__ __forceinline__ int unit_of(unsigned long long t, int n, int stride, int static_passes) {
    constexpr int PER = SPLIT_K > 1 ? GROUPS : 1;
    const int first = static_passes * stride;
    const int valid = (n - first + PER - 1) / PER;  // draws that hold work
    const int period = valid + gridDim.x * (SPLIT_K > 1 ? 1 : WARPS);  // draws per launch: one past the end each
    const int k = (int)(t % (unsigned long long)period);
    return k < valid ? first + k * PER : -1;
}

template <class Epi>
__device__ __forceinline__ void stream_rows_tickets(const unsigned char* __restrict__ w, const float* __restrict__ x,
                                                    const float* __restrict__ gamma, float eps, Epi& epi,
                                                    unsigned long long* counter) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, grp = warp / SPLIT_K, part = warp % SPLIT_K;
    const int n = epi.units();
    const int stride = gridDim.x * GROUPS;
    constexpr bool BLOCK_DRAWS = SPLIT_K > 1;
    __shared__ float red[2][WARPS][ROWS + 1];
    __shared__ int drawn[2];  // BLOCK_DRAWS: the first unit of pass j + 2 in drawn[j & 1], written before j's barrier
    // passes 0 .. static_passes - 1 stride over the grid; the rest are drawn
    const bool tail = n / stride >= TAIL + 2;
    const int static_passes = tail ? n / stride - TAIL : 0x7fffffff;
    // base + grp is this group's unit: the block's first unit of the pass (a warp that draws keeps its own unit
    // minus grp)
    int base = blockIdx.x * GROUPS;
    if (base >= n) {
        pdl_enter();
        return;
    }
    extern __shared__ float4 xs[];
    XLoader xl{reinterpret_cast<const float4*>(x), reinterpret_cast<const float4*>(gamma), xs, 0.f};
    Chunk a[BATCH][ROWS];
    const unsigned char* rp[ROWS];
    const bool first_live = base + grp < n;
    epi.rows(first_live ? base + grp : 0, w, rp);
    if (EARLY_BATCH) load_batch<true>(rp, first_live, 0, part, lane, a);
    if (LATE_WAIT)
        pdl_launch();
    else
        pdl_enter();
    if (!EARLY_BATCH) load_batch<false>(rp, first_live, 0, part, lane, a);
    const float x_rs = X_SMEM ? stage_x(xl.x4, xl.g4, eps, xs) : 1.0f;
    epi.begin();
    unsigned long long pending = 0;  // the draw for pass j + 2, made in pass j (warps: lane 0; blocks: thread 0)
    bool ahead = false;
    int next_drawn = 0;  // warps: the unit of pass j + 1, drawn in pass j - 1 and resolved as pass j starts
#pragma unroll 1
    for (int j = 0; base < n; ++j) {
        const int u = base + grp;
        if (!BLOCK_DRAWS && u >= n) break;
        const bool static_next = j + 1 < static_passes;
        // pass j + 2 is drawn where it is not static and pass j + 1 holds work (the draw that found none was the
        // agent's last)
        if (!BLOCK_DRAWS) {
            if (!static_next) next_drawn = unit_of(__shfl_sync(0xffffffffu, pending, 0), n, stride, static_passes);
            ahead = j + 2 >= static_passes && (static_next || next_drawn >= 0);
            if (ahead && lane == 0) pending = atomicAdd(counter, 1ull);
        } else if (threadIdx.x == 0) {
            ahead = j + 2 >= static_passes && (static_next || drawn[(j + 1) & 1] >= 0);
            if (ahead) pending = atomicAdd(counter, 1ull);
        }
        float acc[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[r] = 0.f;
        xl.ss = 0.f;
        int next_base = n;
#pragma unroll 1
        for (int b = 0; b < BATCHES; ++b) {
            const bool next_unit = b + 1 == BATCHES;
            if (next_unit) {
                if (static_next) {
                    next_base = base + stride;
                } else {
                    const int d = BLOCK_DRAWS ? drawn[(j + 1) & 1] : next_drawn;
                    next_base = d < 0 ? n : d - (BLOCK_DRAWS ? 0 : grp);
                }
            }
            const int nu = next_unit ? next_base + grp : u;
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
            float (&rb)[WARPS][ROWS + 1] = red[j & 1];
            if (lane == 0) {
#pragma unroll
                for (int r = 0; r < ROWS; ++r) rb[warp][r] = acc[r];
                rb[warp][ROWS] = ss;
            }
            // drawn[j & 1] was last read in pass j - 1, before its barrier
            if (threadIdx.x == 0 && ahead) drawn[j & 1] = unit_of(pending, n, stride, static_passes);
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
        base = next_base;
        if (part != 0 || u >= n || lane != 0) continue;
        if (NORM) {
            const float rs = X_SMEM ? x_rs : 1.0f / sqrtf(ss / (float)K + eps);
#pragma unroll
            for (int r = 0; r < ROWS; ++r) acc[r] *= rs;
        }
        epi(u, acc);
    }
    epi.end();
    if (LATE_WAIT) pdl_wait();
}

#if EPILOGUE != EPI_ROPE
extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS)
gemv_tickets(const unsigned char* __restrict__ w, const float* __restrict__ x, const float* __restrict__ gamma,
             const float* __restrict__ bias, float* __restrict__ y, int n_out, float eps,
             unsigned long long* __restrict__ amax, unsigned long long* __restrict__ tickets)
{
    RowEpilogue epi{bias, y, amax, 0ull, n_out, Fmt::ROW_BYTES};
    stream_rows_tickets(w, x, gamma, eps, epi, tickets);
}
#else
extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS)
gemv_rope_tickets(const unsigned char* __restrict__ w, const float* __restrict__ x, const float* __restrict__ gamma,
                  const float* __restrict__ bias, float* __restrict__ y, int n_pairs, float eps,
                  const DecodeState* __restrict__ st, const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                  bf16* __restrict__ k_cache, bf16* __restrict__ v_cache, int nh, int nkv, int max_ctx, int head0,
                  unsigned long long* __restrict__ tickets)
{
    RopeEpilogue epi{bias, y, st, cos_t, sin_t, k_cache, v_cache, n_pairs, nh, nkv, max_ctx, head0, 0,
                     Fmt::ROW_BYTES};
    stream_rows_tickets(w, x, gamma, eps, epi, tickets);
}
#endif
