// Split-KV decode attention. Grid (splits, kv heads): block (s, h) covers cache rows
// [s*chunk, min((s+1)*chunk, n_cached)) with n_cached = pos + 1 read from the decode state, for the
// GROUP query heads of kv head h, so each K/V row is loaded once. A row is LANES_PER_ROW lanes wide
// (16 bytes each); a warp reads ROW_SLOTS rows at once, ROWS_PER_SLOT times per step. Scores are in
// the base-2 domain (scale2 = scale * log2 e); an empty split writes m = -inf, l = 0.
// Only active = min(splits, ceil(n_cached / min_chunk)) splits work (the others exit), one up to
// one_split_rows cached rows, with chunk = ceil(n_cached / active); the last active block of each kv
// head to finish merges the partials into out, and resets its counter. With one active split the blocks
// of a kv head take its query heads apart, ONE_SPLIT_HEADS each, over every row, and write out directly:
// at a few hundred rows the merge (a count, the partials read back from L2) costs more than the split
// saves, and a block's chain of dependent work is as long as the heads it takes.
// The position is read before the PDL wait (the previous step wrote it) and rows that earlier steps
// appended start loading; the row this step appends waits.
// Defines: HEAD_DIM, GROUP (query heads per kv head), WARPS, MAX_SPLITS (the host's split limit),
// ONE_SPLIT_HEADS (a divisor of GROUP).
// budget: attn_decode=248
// defines: HEAD_DIM=128 GROUP=4 WARPS=4 MAX_SPLITS=128 ONE_SPLIT_HEADS=1
// defines: HEAD_DIM=128 GROUP=4 WARPS=8 MAX_SPLITS=128 ONE_SPLIT_HEADS=1
// defines: HEAD_DIM=128 GROUP=8 WARPS=4 MAX_SPLITS=128 ONE_SPLIT_HEADS=1
// defines: HEAD_DIM=64 GROUP=7 WARPS=4 MAX_SPLITS=128 ONE_SPLIT_HEADS=1
// defines: HEAD_DIM=64 GROUP=7 WARPS=8 MAX_SPLITS=128 ONE_SPLIT_HEADS=1
// defines: HEAD_DIM=16 GROUP=3 WARPS=4 MAX_SPLITS=32 ONE_SPLIT_HEADS=1
// defines: HEAD_DIM=128 GROUP=4 WARPS=8 MAX_SPLITS=128 ONE_SPLIT_HEADS=1 SCATTER=0
// defines: HEAD_DIM=128 GROUP=2 WARPS=8 MAX_SPLITS=128 ONE_SPLIT_HEADS=1
// defines: HEAD_DIM=64 GROUP=4 WARPS=8 MAX_SPLITS=128 ONE_SPLIT_HEADS=1
// defines: HEAD_DIM=128 GROUP=4 WARPS=8 MAX_SPLITS=128 ONE_SPLIT_HEADS=4
// defines: HEAD_DIM=64 GROUP=7 WARPS=8 MAX_SPLITS=128 ONE_SPLIT_HEADS=7
// defines: HEAD_DIM=64 GROUP=4 WARPS=8 MAX_SPLITS=128 ONE_SPLIT_HEADS=2
// defines: HEAD_DIM=128 WARPS=8 GROUP=7 MAX_SPLITS=128 ONE_SPLIT_HEADS=1
// defines: HEAD_DIM=128 WARPS=8 GROUP=6 MAX_SPLITS=128 ONE_SPLIT_HEADS=1
// defines: HEAD_DIM=64 WARPS=8 GROUP=3 MAX_SPLITS=128 ONE_SPLIT_HEADS=1
#include "common.cuh"

#if !defined(HEAD_DIM) || !defined(GROUP) || !defined(WARPS) || !defined(MAX_SPLITS) || !defined(ONE_SPLIT_HEADS)
#error "attention.cu needs HEAD_DIM, GROUP, WARPS, MAX_SPLITS and ONE_SPLIT_HEADS"
#endif
// rows each slot of a warp loads per step
#ifndef ROWS_PER_SLOT
#define ROWS_PER_SLOT 2
#endif
// resident blocks per SM to compile for: 16 warps while the query heads of a group fit in 128
// registers (GROUP <= 4), else 8
#ifndef MIN_BLOCKS
#define MIN_BLOCKS (GROUP <= 4 ? 16 / WARPS : (WARPS < 8 ? 8 / WARPS : 1))
#endif
// the running max moves only when a score passes it by more than this (base-2 units)
#ifndef RESCALE_MARGIN
#define RESCALE_MARGIN 8.0f
#endif
#define LANES_PER_ROW (HEAD_DIM / 8)
#define ROW_SLOTS (32 / LANES_PER_ROW)  // rows a warp loads at once
#define WARP_ROWS (ROW_SLOTS * ROWS_PER_SLOT)  // rows a warp covers per step
// dot products per lane per step, for a pass over G query heads at once
constexpr int lane_dots(int g) { return ROWS_PER_SLOT * g; }
// sum a step's lane_dots(G) dot products over a row's LANES_PER_ROW lanes with a reduce-scatter (each level
// halves the values a lane holds) and broadcast the totals, instead of lane_dots(G) full butterflies, where
// the count allows it; SCATTER=0 never does
#ifndef SCATTER
#define SCATTER 1
#endif
constexpr bool use_scatter(int g) {
    return SCATTER && (lane_dots(g) & (lane_dots(g) - 1)) == 0 && lane_dots(g) <= LANES_PER_ROW && lane_dots(g) <= 8;
}
// query heads per block up to one_split_rows cached rows (the host's AttnTuning.one_split_heads): the
// GROUP / ONE_SPLIT_HEADS blocks of a kv head take its query heads apart, with no merge, so that each
// block's dependent chain (dot products, softmax, the warps' merge) is ONE_SPLIT_HEADS heads long
static_assert(GROUP % ONE_SPLIT_HEADS == 0, "one split's blocks take equal shares of a group's query heads");

static_assert(HEAD_DIM % 8 == 0 && HEAD_DIM <= 256 && (LANES_PER_ROW & (LANES_PER_ROW - 1)) == 0,
              "head_dim must be 8 * 2^k, at most 256");
static_assert(MAX_SPLITS % 32 == 0, "the merge gives each lane MAX_SPLITS / 32 splits");

template <int G>
struct Part {
    float m[G], l[G], o[G][8];
};

template <int G>
__device__ __forceinline__ void merge(Part<G>& a, int g, float m2, float l2, const float (&o2)[8]) {
    const float mn = fmaxf(a.m[g], m2);
    if (mn == NEG_INF) return;
    const float c1 = exp2f(a.m[g] - mn), c2 = exp2f(m2 - mn);
    a.l[g] = a.l[g] * c1 + l2 * c2;
#pragma unroll
    for (int e = 0; e < 8; ++e) a.o[g][e] = a.o[g][e] * c1 + o2[e] * c2;
    a.m[g] = mn;
}

#define COMBINE_BATCH 16  // split partials each thread has in flight while merging

// o first and 16-byte aligned: the combine reuses it as float4 scratch
struct __align__(16) Merged {
    float o[WARPS][GROUP][HEAD_DIM];
    float m[WARPS][GROUP], l[WARPS][GROUP];
};

#define FLT_BIG 1e30f

// sum of a[e] * b[e] over 8 elements as two chains of four, so the dependent FMAs are half as long
__device__ __forceinline__ float dot8f(const float (&a)[8], const float (&b)[8]) {
    float u = a[0] * b[0], v = a[4] * b[4];
#pragma unroll
    for (int e = 1; e < 4; ++e) {
        u = fmaf(a[e], b[e], u);
        v = fmaf(a[e + 4], b[e + 4], v);
    }
    return u + v;
}

// v[i] summed over the LANES_PER_ROW lanes of this lane's row group: returns the total of value
// sub / (LANES_PER_ROW / LD), which lanes sub = idx * (LANES_PER_ROW / LD) ... hold
template <int LD>
__device__ __forceinline__ float scatter_sum(float (&v)[LD], int sub) {
#pragma unroll
    for (int c = LD, o = LANES_PER_ROW / 2; c > 1; c >>= 1, o >>= 1) {
        const bool up = (sub & o) != 0;
#pragma unroll
        for (int i = 0; i < c / 2; ++i) {
            const float keep = up ? v[i + c / 2] : v[i];
            const float send = up ? v[i] : v[i + c / 2];
            v[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
        }
    }
    float t = v[0];
#pragma unroll
    for (int o = LANES_PER_ROW / (2 * LD); o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
    return t;
}

// rows [lo, hi) of kv head kvh for its G query heads from head0 on (of the GROUP): each warp's partial, left
// in sm for merged() as heads 0..G-1. Row `fresh` (the one
// the previous kernel appends) is read after the PDL wait; each warp's first other rows are loaded
// before it, since earlier steps wrote them. The running max is a reference that moves only when a
// score exceeds it by more than RESCALE_MARGIN (so o and l are rarely rescaled, and every exp2 stays
// below 2^RESCALE_MARGIN); the true max, tracked beside it, becomes the reference at the end.
template <int G>
__device__ __forceinline__ void attend(const float* __restrict__ q, const bf16* __restrict__ k_cache,
                                       const bf16* __restrict__ v_cache, int kvh, int head0, int lo, int hi,
                                       int fresh, int max_ctx, float scale2, Merged& sm) {
    constexpr int LD = lane_dots(G);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int slot = lane / LANES_PER_ROW, sub = lane % LANES_PER_ROW;
    const uint4* kb = reinterpret_cast<const uint4*>(k_cache + (size_t)kvh * max_ctx * HEAD_DIM) + sub;
    const uint4* vb = reinterpret_cast<const uint4*>(v_cache + (size_t)kvh * max_ctx * HEAD_DIM) + sub;

    // software pipelined: the next step's rows are in flight while this step's are used
    uint4 nk[ROWS_PER_SLOT], nv[ROWS_PER_SLOT];
#pragma unroll
    for (int r = 0; r < ROWS_PER_SLOT; ++r) {
        const int row = lo + warp * WARP_ROWS + r * ROW_SLOTS + slot;
        const bool early = row < hi && row != fresh;
        nk[r] = early ? ld_early(kb + (size_t)row * LANES_PER_ROW) : make_uint4(0, 0, 0, 0);
        nv[r] = early ? ld_early(vb + (size_t)row * LANES_PER_ROW) : make_uint4(0, 0, 0, 0);
    }
    pdl_enter();
#pragma unroll
    for (int r = 0; r < ROWS_PER_SLOT; ++r) {
        const int row = lo + warp * WARP_ROWS + r * ROW_SLOTS + slot;
        if (row == fresh && row < hi) {
            nk[r] = ld_early(kb + (size_t)row * LANES_PER_ROW);
            nv[r] = ld_early(vb + (size_t)row * LANES_PER_ROW);
        }
    }
    // q pre-scaled, so dot products come out in the base-2 domain
    float qf[G][8];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const float4* qp =
            reinterpret_cast<const float4*>(q + (size_t)(kvh * GROUP + head0 + g) * HEAD_DIM + sub * 8);
        const float4 a = qp[0], b = qp[1];
        qf[g][0] = a.x * scale2; qf[g][1] = a.y * scale2; qf[g][2] = a.z * scale2; qf[g][3] = a.w * scale2;
        qf[g][4] = b.x * scale2; qf[g][5] = b.y * scale2; qf[g][6] = b.z * scale2; qf[g][7] = b.w * scale2;
    }
    // a finite floor as the first reference: masked rows (-inf) then give exp2 = 0, never NaN
    Part<G> p;
    float top[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        p.m[g] = -FLT_BIG;
        top[g] = NEG_INF;
        p.l[g] = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) p.o[g][e] = 0.f;
    }

    for (int base = lo + warp * WARP_ROWS; base < hi; base += WARPS * WARP_ROWS) {
        uint4 kk[ROWS_PER_SLOT], vv[ROWS_PER_SLOT];
#pragma unroll
        for (int r = 0; r < ROWS_PER_SLOT; ++r) {
            const int row = base + WARPS * WARP_ROWS + r * ROW_SLOTS + slot;
            kk[r] = nk[r];
            vv[r] = nv[r];
            nk[r] = row < hi ? __ldg(kb + (size_t)row * LANES_PER_ROW) : make_uint4(0, 0, 0, 0);
            nv[r] = row < hi ? __ldg(vb + (size_t)row * LANES_PER_ROW) : make_uint4(0, 0, 0, 0);
        }
        float s[ROWS_PER_SLOT][G];
        if constexpr (use_scatter(G)) {
            float dv[LD];
#pragma unroll
            for (int r = 0; r < ROWS_PER_SLOT; ++r) {
                float kf[8];
                unpack8(kk[r], kf);
#pragma unroll
                for (int g = 0; g < G; ++g) dv[r * G + g] = dot8f(qf[g], kf);
            }
            const float tot = scatter_sum(dv, sub);
#pragma unroll
            for (int r = 0; r < ROWS_PER_SLOT; ++r) {
                const bool ok = base + r * ROW_SLOTS + slot < hi;
#pragma unroll
                for (int g = 0; g < G; ++g) {
                    const float d =
                        __shfl_sync(0xffffffffu, tot, (r * G + g) * (LANES_PER_ROW / LD), LANES_PER_ROW);
                    s[r][g] = ok ? d : NEG_INF;
                }
            }
        } else {
#pragma unroll
            for (int r = 0; r < ROWS_PER_SLOT; ++r) {
                float kf[8];
                unpack8(kk[r], kf);
                const bool ok = base + r * ROW_SLOTS + slot < hi;
#pragma unroll
                for (int g = 0; g < G; ++g) {
                    const float d = group_sum<LANES_PER_ROW>(dot8f(qf[g], kf));
                    s[r][g] = ok ? d : NEG_INF;
                }
            }
        }
        float vf[ROWS_PER_SLOT][8];
#pragma unroll
        for (int r = 0; r < ROWS_PER_SLOT; ++r) unpack8(vv[r], vf[r]);
#pragma unroll
        for (int g = 0; g < G; ++g) {
            float mx = s[0][g];
#pragma unroll
            for (int r = 1; r < ROWS_PER_SLOT; ++r) mx = fmaxf(mx, s[r][g]);
            top[g] = fmaxf(top[g], mx);
            if (mx > p.m[g] + RESCALE_MARGIN) {  // rare: the first live row, or a much larger score
                const float corr = fast_exp2(p.m[g] - mx);
                p.l[g] *= corr;
#pragma unroll
                for (int e = 0; e < 8; ++e) p.o[g][e] *= corr;
                p.m[g] = mx;
            }
            float e2[ROWS_PER_SLOT];
#pragma unroll
            for (int r = 0; r < ROWS_PER_SLOT; ++r) {
                e2[r] = fast_exp2(s[r][g] - p.m[g]);
                p.l[g] += e2[r];
            }
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                float o = p.o[g][e];
#pragma unroll
                for (int r = 0; r < ROWS_PER_SLOT; ++r) o = fmaf(e2[r], vf[r][e], o);
                p.o[g][e] = o;
            }
        }
    }
    // the true max becomes the reference (-inf, with l = 0 and o = 0, for a warp with no rows)
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const float corr = top[g] == NEG_INF ? 1.0f : exp2f(p.m[g] - top[g]);
        p.l[g] *= corr;
#pragma unroll
        for (int e = 0; e < 8; ++e) p.o[g][e] *= corr;
        p.m[g] = top[g];
    }

    // merge the row slots of each warp (lanes with the same sub)
#pragma unroll
    for (int off = LANES_PER_ROW; off < 32; off <<= 1) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const float m2 = __shfl_xor_sync(0xffffffffu, p.m[g], off);
            const float l2 = __shfl_xor_sync(0xffffffffu, p.l[g], off);
            float o2[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) o2[e] = __shfl_xor_sync(0xffffffffu, p.o[g][e], off);
            merge(p, g, m2, l2, o2);
        }
    }

    // then the warps, in order
    if (lane < LANES_PER_ROW) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
#pragma unroll
            for (int e = 0; e < 8; ++e) sm.o[warp][g][sub * 8 + e] = p.o[g][e];
            if (lane == 0) {
                sm.m[warp][g] = p.m[g];
                sm.l[warp][g] = p.l[g];
            }
        }
    }
    __syncthreads();
}

// the block's partial (m, l, unnormalised o) of head g, element e
__device__ __forceinline__ float merged(const Merged& sm, int g, int e, float& m, float& l) {
    m = NEG_INF;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) m = fmaxf(m, sm.m[w][g]);
    float o = 0.f;
    l = 0.f;
    if (m != NEG_INF) {
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float c = exp2f(sm.m[w][g] - m);
            l += sm.l[w][g] * c;
            o += sm.o[w][g][e] * c;
        }
    }
    return o;
}

__device__ __forceinline__ void store_partials(const Merged& sm, int kvh, int split, int splits, float* pm,
                                               float* pl, float* pacc) {
    for (int t = threadIdx.x; t < GROUP * HEAD_DIM; t += WARPS * 32) {
        const int g = t / HEAD_DIM, e = t % HEAD_DIM;
        float m, l;
        const float o = merged(sm, g, e, m, l);
        const size_t head = (size_t)kvh * GROUP + g;
        pacc[(head * splits + split) * HEAD_DIM + e] = o;
        if (e == 0) {
            pm[head * splits + split] = m;
            pl[head * splits + split] = l;
        }
    }
}

// the last block of kv head kvh: out = sum_s w_s acc_s / l_s / sum_s w_s over the active splits,
// w_s = 2^(m_s + log2 l_s - max); partials are read through L2 (other blocks wrote them). TEAMS
// thread teams take interleaved runs of COMBINE_BATCH splits, then sum in team order; sm is free by
// now. Shared memory: the weights [GROUP][MAX_SPLITS] and 1 / sum_s w_s per head.
__device__ __forceinline__ void combine(const float* pm, const float* pl, const float* pacc, float* __restrict__ out,
                                        int kvh, int splits, int active, Merged& sm) {
    constexpr int VEC = HEAD_DIM / 4, COLS = GROUP * VEC, THREADS = WARPS * 32;
    constexpr int SPLITS_PER_LANE = MAX_SPLITS / 32;
    constexpr int TEAMS = COLS >= THREADS ? 1 : (THREADS / COLS < WARPS ? THREADS / COLS : WARPS);
    __shared__ float wgt[GROUP][MAX_SPLITS];
    __shared__ float inv_den[GROUP];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int g = warp; g < GROUP; g += WARPS) {
        const size_t h = (size_t)kvh * GROUP + g;
        float l[SPLITS_PER_LANE], lse[SPLITS_PER_LANE], big = NEG_INF;
#pragma unroll
        for (int j = 0; j < SPLITS_PER_LANE; ++j) {
            const int s = lane + 32 * j;
            l[j] = s < active ? __ldcg(pl + h * splits + s) : 0.f;
            const float m = s < active ? __ldcg(pm + h * splits + s) : NEG_INF;
            lse[j] = l[j] > 0.f ? m + log2f(l[j]) : NEG_INF;
            big = fmaxf(big, lse[j]);
        }
        big = warp_max(big);
        float den = 0.f;
#pragma unroll
        for (int j = 0; j < SPLITS_PER_LANE; ++j) {
            const int s = lane + 32 * j;
            const float w = l[j] > 0.f ? exp2f(lse[j] - big) : 0.f;
            den += w;
            if (s < active) wgt[g][s] = l[j] > 0.f ? w * __frcp_rn(l[j]) : 0.f;
        }
        den = warp_sum(den);
        if (lane == 0) inv_den[g] = __frcp_rn(den);
    }
    __syncthreads();
    float4* red = reinterpret_cast<float4*>(&sm.o[0][0][0]);
    for (int t = threadIdx.x; t < (TEAMS == 1 ? COLS : TEAMS * COLS); t += THREADS) {
        const int c = t % COLS, grp = t / COLS;
        const int g = c / VEC, j = c % VEC;
        const size_t h = (size_t)kvh * GROUP + g;
        const float4* acc = reinterpret_cast<const float4*>(pacc + h * splits * HEAD_DIM) + j;
        float4 num = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int s0 = grp * COMBINE_BATCH; s0 < active; s0 += TEAMS * COMBINE_BATCH) {
            float4 a[COMBINE_BATCH];
#pragma unroll
            for (int b = 0; b < COMBINE_BATCH; ++b)
                a[b] = s0 + b < active ? __ldcg(acc + (size_t)(s0 + b) * VEC) : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int b = 0; b < COMBINE_BATCH; ++b) {
                const float f = s0 + b < active ? wgt[g][s0 + b] : 0.f;
                num.x = fmaf(f, a[b].x, num.x);
                num.y = fmaf(f, a[b].y, num.y);
                num.z = fmaf(f, a[b].z, num.z);
                num.w = fmaf(f, a[b].w, num.w);
            }
        }
        if (TEAMS == 1) {
            const float inv = inv_den[g];
            reinterpret_cast<float4*>(out + h * HEAD_DIM)[j] =
                make_float4(num.x * inv, num.y * inv, num.z * inv, num.w * inv);
        } else {
            red[t] = num;
        }
    }
    if (TEAMS == 1) return;
    __syncthreads();
    for (int c = threadIdx.x; c < COLS; c += THREADS) {
        float4 num = red[c];
#pragma unroll
        for (int q = 1; q < TEAMS; ++q) {
            const float4 r = red[q * COLS + c];
            num.x += r.x;
            num.y += r.y;
            num.z += r.z;
            num.w += r.w;
        }
        const int g = c / VEC, j = c % VEC;
        const float inv = inv_den[g];
        reinterpret_cast<float4*>(out + ((size_t)kvh * GROUP + g) * HEAD_DIM)[j] =
            make_float4(num.x * inv, num.y * inv, num.z * inv, num.w * inv);
    }
}

// q: [nh*HEAD_DIM] f32 (after RoPE); k_cache, v_cache: this layer's [kv_heads, max_ctx, HEAD_DIM] bf16;
// pm, pl: [nh, splits]; pacc: [nh, splits, HEAD_DIM] (unnormalised); out: [nh*HEAD_DIM] f32;
// counters: [kv_heads] zero between launches; splits <= MAX_SPLITS
extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS)
attn_decode(const float* __restrict__ q, const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache,
            const DecodeState* __restrict__ st, float* pm, float* pl, float* pacc, float* __restrict__ out,
            unsigned* counters, int max_ctx, float scale2, int min_chunk, int one_split_rows)
{
    // the position is the previous step's: no kernel of this step writes it
    const int splits = gridDim.x, split = blockIdx.x, kvh = blockIdx.y;
    const int n_cached = min(max(__ldcg(&st->pos), 0) + 1, max_ctx);  // coherent: it stays above the wait
    const int active = n_cached <= one_split_rows ? 1 : min(splits, (n_cached + min_chunk - 1) / min_chunk);
    __shared__ Merged sm;
    if (active == 1) {
        // ONE_SPLIT_HEADS query heads per block over every row, written out directly
        constexpr int H = ONE_SPLIT_HEADS;
        for (int h0 = split * H; h0 < GROUP; h0 += splits * H) {
            attend<H>(q, k_cache, v_cache, kvh, h0, 0, n_cached, n_cached - 1, max_ctx, scale2, sm);
            for (int t = threadIdx.x; t < H * HEAD_DIM; t += WARPS * 32) {
                const int g = t / HEAD_DIM, e = t % HEAD_DIM;
                float m, l;
                const float o = merged(sm, g, e, m, l);
                out[((size_t)kvh * GROUP + h0 + g) * HEAD_DIM + e] = o * __frcp_rn(l);
            }
            __syncthreads();  // sm is the next head's
        }
        return;
    }
    if (split >= active) return;
    const int chunk = (n_cached + active - 1) / active;
    const int lo = min(split * chunk, n_cached), hi = min(lo + chunk, n_cached);
    __shared__ bool last;
    attend<GROUP>(q, k_cache, v_cache, kvh, 0, lo, hi, n_cached - 1, max_ctx, scale2, sm);
    store_partials(sm, kvh, split, splits, pm, pl, pacc);
    // the block's writes, then its count: the add releases what the barrier ordered before it, and the
    // last block's add acquires what every other block released
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned before;
        asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(before) : "l"(counters + kvh) : "memory");
        last = before == (unsigned)active - 1;
    }
    __syncthreads();
    if (!last) return;
    combine(pm, pl, pacc, out, kvh, splits, active, sm);
    if (threadIdx.x == 0) counters[kvh] = 0;
}
