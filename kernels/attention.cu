// Split-KV decode attention. Grid (splits, kv heads): block (s, h) covers cache rows
// [s*chunk, min((s+1)*chunk, nkv)) with nkv = pos + 1 read from the decode state, for the G query
// heads of kv head h, so each K/V row is loaded once. A row is HD/8 lanes wide (16 bytes each); a
// warp reads 32/(HD/8) rows at once, R times per step. Scores are in the base-2 domain
// (scale2 = scale * log2 e); an empty split writes m = -inf, l = 0.
// attn_partial: chunk = ceil(nkv / splits), partials for the separate combine pass.
// attn_decode: only active = min(splits, ceil(nkv / min_chunk)) splits work (the others exit), with
// chunk = ceil(nkv / active); the last active block of each kv head to finish merges the partials
// (as the combine pass does) into out, and resets its counter. With one active split the block
// writes out directly. Both read the position before the PDL wait (the previous step wrote it) and
// start loading rows that earlier steps appended; the row this step appends waits.
// budget: attn_partial=248 attn_decode=248
// defines: HD=128 G=4
// defines: HD=128 G=4 WARPS=8
// defines: HD=128 G=8
// defines: HD=64 G=7
// defines: HD=64 G=7 WARPS=8
// defines: HD=16 G=3
// defines: HD=128 G=4 WARPS=8 SCATTER=0
// defines: HD=128 G=2 WARPS=8
// defines: HD=64 G=4 WARPS=8
#include "common.cuh"

#ifndef WARPS
#define WARPS 4
#endif
#ifndef R
#define R 2
#endif
// resident blocks per SM to compile for: 16 warps while the query heads of a group fit in 128
// registers (G <= 4), else 8
#ifndef MINB
#define MINB (G <= 4 ? 16 / WARPS : (WARPS < 8 ? 8 / WARPS : 1))
#endif
#ifndef RESCALE
#define RESCALE 8.0f
#endif
#ifndef NOCOMPUTE
#define NOCOMPUTE 0
#endif
// NOCOMPUTE (a diagnostic, scripts/attn_bench.py): stream the rows, fold their bits, skip the math
#define FOLD_ONLY(kk, vv)                                                                         \
    {                                                                                             \
        _Pragma("unroll") for (int r = 0; r < R; ++r) p.o[0][0] +=                                \
            __uint_as_float((kk[r].x ^ kk[r].w ^ vv[r].y ^ vv[r].z) & 0x3f7fffffu);             \
        continue;                                                                                 \
    }
#define LPR (HD / 8)
#define SLOTS (32 / LPR)
#define STEP (SLOTS * R)
#define NSC (R * G)  // dot products per lane per step
// SCATTER: sum a step's NSC dot products over a row's LPR lanes with a reduce-scatter (each level
// halves the values a lane holds) and broadcast the totals, instead of NSC full butterflies
#ifndef SCATTER
#define SCATTER ((NSC & (NSC - 1)) == 0 && NSC <= LPR && NSC <= 8)
#endif

static_assert(HD % 8 == 0 && HD <= 256 && (LPR & (LPR - 1)) == 0, "head_dim must be 8 * 2^k, at most 256");

struct Part {
    float m[G], l[G], o[G][8];
};

__device__ __forceinline__ void merge(Part& a, int g, float m2, float l2, const float (&o2)[8]) {
    const float mn = fmaxf(a.m[g], m2);
    if (mn == NEG_INF) return;
    const float c1 = exp2f(a.m[g] - mn), c2 = exp2f(m2 - mn);
    a.l[g] = a.l[g] * c1 + l2 * c2;
#pragma unroll
    for (int e = 0; e < 8; ++e) a.o[g][e] = a.o[g][e] * c1 + o2[e] * c2;
    a.m[g] = mn;
}

#ifndef MAX_SPLITS
#define MAX_SPLITS 128
#endif
#define CB 16

// o first and 16-byte aligned: the combine reuses it as float4 scratch
struct __align__(16) Merged {
    float o[WARPS][G][HD];
    float m[WARPS][G], l[WARPS][G];
};

#define FLT_BIG 1e30f

// 2^x by the hardware approximation (what exp2f becomes under fast math); 0 for x = -inf
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

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

#if SCATTER
// v[i] summed over the LPR lanes of this lane's row group: returns the total of value sub / (LPR / NSC),
// which lanes sub = idx * (LPR / NSC) ... hold
__device__ __forceinline__ float scatter_sum(float (&v)[NSC], int sub) {
#pragma unroll
    for (int c = NSC, o = LPR / 2; c > 1; c >>= 1, o >>= 1) {
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
    for (int o = LPR / (2 * NSC); o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
    return t;
}
#endif

// rows [lo, hi) of kv head kvh: each warp's partial, left in sm for merged(). Row `fresh` (the one
// the previous kernel appends) is read after the PDL wait; each warp's first other rows are loaded
// before it, since earlier steps wrote them. The running max is a reference that moves only when a
// score exceeds it by more than RESCALE (so o and l are rarely rescaled, and every exp2 stays below
// 2^RESCALE); the true max, tracked beside it, becomes the reference at the end.
__device__ __forceinline__ void attend(const float* __restrict__ q, const bf16* __restrict__ k_cache,
                                       const bf16* __restrict__ v_cache, int kvh, int lo, int hi, int fresh,
                                       int max_ctx, float scale2, Merged& sm) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int slot = lane / LPR, sub = lane % LPR;
    const uint4* kb = reinterpret_cast<const uint4*>(k_cache + (size_t)kvh * max_ctx * HD) + sub;
    const uint4* vb = reinterpret_cast<const uint4*>(v_cache + (size_t)kvh * max_ctx * HD) + sub;

    // software pipelined: the next step's rows are in flight while this step's are used
    uint4 nk[R], nv[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int row = lo + warp * STEP + r * SLOTS + slot;
        const bool early = row < hi && row != fresh;
        nk[r] = early ? ld_early(kb + (size_t)row * LPR) : make_uint4(0, 0, 0, 0);
        nv[r] = early ? ld_early(vb + (size_t)row * LPR) : make_uint4(0, 0, 0, 0);
    }
    pdl_enter();
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int row = lo + warp * STEP + r * SLOTS + slot;
        if (row == fresh && row < hi) {
            nk[r] = ld_early(kb + (size_t)row * LPR);
            nv[r] = ld_early(vb + (size_t)row * LPR);
        }
    }
    // q pre-scaled, so dot products come out in the base-2 domain
    float qf[G][8];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const float4* qp = reinterpret_cast<const float4*>(q + (size_t)(kvh * G + g) * HD + sub * 8);
        const float4 a = qp[0], b = qp[1];
        qf[g][0] = a.x * scale2; qf[g][1] = a.y * scale2; qf[g][2] = a.z * scale2; qf[g][3] = a.w * scale2;
        qf[g][4] = b.x * scale2; qf[g][5] = b.y * scale2; qf[g][6] = b.z * scale2; qf[g][7] = b.w * scale2;
    }
    // a finite floor as the first reference: masked rows (-inf) then give exp2 = 0, never NaN
    Part p;
    float top[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        p.m[g] = -FLT_BIG;
        top[g] = NEG_INF;
        p.l[g] = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) p.o[g][e] = 0.f;
    }

    for (int base = lo + warp * STEP; base < hi; base += WARPS * STEP) {
        uint4 kk[R], vv[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int row = base + WARPS * STEP + r * SLOTS + slot;
            kk[r] = nk[r];
            vv[r] = nv[r];
            nk[r] = row < hi ? __ldg(kb + (size_t)row * LPR) : make_uint4(0, 0, 0, 0);
            nv[r] = row < hi ? __ldg(vb + (size_t)row * LPR) : make_uint4(0, 0, 0, 0);
        }
#if NOCOMPUTE
        FOLD_ONLY(kk, vv);
#endif
        float s[R][G];
#if SCATTER
        float dv[NSC];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            float kf[8];
            unpack8(kk[r], kf);
#pragma unroll
            for (int g = 0; g < G; ++g) dv[r * G + g] = dot8f(qf[g], kf);
        }
        const float tot = scatter_sum(dv, sub);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const bool ok = base + r * SLOTS + slot < hi;
#pragma unroll
            for (int g = 0; g < G; ++g) {
                const float d = __shfl_sync(0xffffffffu, tot, (r * G + g) * (LPR / NSC), LPR);
                s[r][g] = ok ? d : NEG_INF;
            }
        }
#else
#pragma unroll
        for (int r = 0; r < R; ++r) {
            float kf[8];
            unpack8(kk[r], kf);
            const bool ok = base + r * SLOTS + slot < hi;
#pragma unroll
            for (int g = 0; g < G; ++g) {
                const float d = group_sum<LPR>(dot8f(qf[g], kf));
                s[r][g] = ok ? d : NEG_INF;
            }
        }
#endif
        float vf[R][8];
#pragma unroll
        for (int r = 0; r < R; ++r) unpack8(vv[r], vf[r]);
#pragma unroll
        for (int g = 0; g < G; ++g) {
            float mx = s[0][g];
#pragma unroll
            for (int r = 1; r < R; ++r) mx = fmaxf(mx, s[r][g]);
            top[g] = fmaxf(top[g], mx);
            if (mx > p.m[g] + RESCALE) {  // rare: the first live row, or a much larger score
                const float corr = fast_exp2(p.m[g] - mx);
                p.l[g] *= corr;
#pragma unroll
                for (int e = 0; e < 8; ++e) p.o[g][e] *= corr;
                p.m[g] = mx;
            }
            float e2[R];
#pragma unroll
            for (int r = 0; r < R; ++r) {
                e2[r] = fast_exp2(s[r][g] - p.m[g]);
                p.l[g] += e2[r];
            }
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                float o = p.o[g][e];
#pragma unroll
                for (int r = 0; r < R; ++r) o = fmaf(e2[r], vf[r][e], o);
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
    for (int off = LPR; off < 32; off <<= 1) {
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
    if (lane < LPR) {
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
    for (int t = threadIdx.x; t < G * HD; t += WARPS * 32) {
        const int g = t / HD, e = t % HD;
        float m, l;
        const float o = merged(sm, g, e, m, l);
        const size_t head = (size_t)kvh * G + g;
        pacc[(head * splits + split) * HD + e] = o;
        if (e == 0) {
            pm[head * splits + split] = m;
            pl[head * splits + split] = l;
        }
    }
}

// q: [nh*HD] f32 (after RoPE); k_cache, v_cache: this layer's [nkv_heads, max_ctx, HD] bf16;
// pm, pl: [nh, splits]; pacc: [nh, splits, HD] (unnormalised)
extern "C" __global__ void __launch_bounds__(WARPS * 32, MINB)
attn_partial(const float* __restrict__ q, const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache,
             const DecodeState* __restrict__ st, float* __restrict__ pm, float* __restrict__ pl,
             float* __restrict__ pacc, int max_ctx, float scale2)
{
    // the position is the previous step's: no kernel of this step writes it
    const int splits = gridDim.x, split = blockIdx.x, kvh = blockIdx.y;
    const int nkv = min(max(st->pos, 0) + 1, max_ctx);
    const int chunk = (nkv + splits - 1) / splits;
    const int lo = min(split * chunk, nkv), hi = min(lo + chunk, nkv);
    __shared__ Merged sm;
    attend(q, k_cache, v_cache, kvh, lo, hi, nkv - 1, max_ctx, scale2, sm);
    store_partials(sm, kvh, split, splits, pm, pl, pacc);
}

// the last block of kv head kvh: out = sum_s w_s acc_s / l_s / sum_s w_s over the active splits,
// w_s = 2^(m_s + log2 l_s - max); partials are read through L2 (other blocks wrote them). GROUPS
// thread groups take interleaved runs of CB splits, then sum in group order; sm is free by now.
__device__ __forceinline__ void combine(const float* pm, const float* pl, const float* pacc, float* __restrict__ out,
                                        int kvh, int splits, int active, Merged& sm) {
    constexpr int VEC = HD / 4, COLS = G * VEC, THREADS = WARPS * 32, PER = MAX_SPLITS / 32;
    constexpr int GROUPS = COLS >= THREADS ? 1 : (THREADS / COLS < WARPS ? THREADS / COLS : WARPS);
    __shared__ float wgt[G][MAX_SPLITS];
    __shared__ float inv_den[G];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int g = warp; g < G; g += WARPS) {
        const size_t h = (size_t)kvh * G + g;
        float l[PER], lse[PER], big = NEG_INF;
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            const int s = lane + 32 * j;
            l[j] = s < active ? __ldcg(pl + h * splits + s) : 0.f;
            const float m = s < active ? __ldcg(pm + h * splits + s) : NEG_INF;
            lse[j] = l[j] > 0.f ? m + log2f(l[j]) : NEG_INF;
            big = fmaxf(big, lse[j]);
        }
        big = warp_max(big);
        float den = 0.f;
#pragma unroll
        for (int j = 0; j < PER; ++j) {
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
    for (int t = threadIdx.x; t < (GROUPS == 1 ? COLS : GROUPS * COLS); t += THREADS) {
        const int c = t % COLS, grp = t / COLS;
        const int g = c / VEC, j = c % VEC;
        const size_t h = (size_t)kvh * G + g;
        const float4* acc = reinterpret_cast<const float4*>(pacc + h * splits * HD) + j;
        float4 num = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int s0 = grp * CB; s0 < active; s0 += GROUPS * CB) {
            float4 a[CB];
#pragma unroll
            for (int b = 0; b < CB; ++b)
                a[b] = s0 + b < active ? __ldcg(acc + (size_t)(s0 + b) * VEC) : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int b = 0; b < CB; ++b) {
                const float f = s0 + b < active ? wgt[g][s0 + b] : 0.f;
                num.x = fmaf(f, a[b].x, num.x);
                num.y = fmaf(f, a[b].y, num.y);
                num.z = fmaf(f, a[b].z, num.z);
                num.w = fmaf(f, a[b].w, num.w);
            }
        }
        if (GROUPS == 1) {
            const float inv = inv_den[g];
            reinterpret_cast<float4*>(out + h * HD)[j] = make_float4(num.x * inv, num.y * inv, num.z * inv, num.w * inv);
        } else {
            red[t] = num;
        }
    }
    if (GROUPS == 1) return;
    __syncthreads();
    for (int c = threadIdx.x; c < COLS; c += THREADS) {
        float4 num = red[c];
#pragma unroll
        for (int q = 1; q < GROUPS; ++q) {
            const float4 r = red[q * COLS + c];
            num.x += r.x;
            num.y += r.y;
            num.z += r.z;
            num.w += r.w;
        }
        const int g = c / VEC, j = c % VEC;
        const float inv = inv_den[g];
        reinterpret_cast<float4*>(out + ((size_t)kvh * G + g) * HD)[j] =
            make_float4(num.x * inv, num.y * inv, num.z * inv, num.w * inv);
    }
}

// as attn_partial, plus out: [nh*HD] f32; counters: [nkv_heads] zero between launches;
// splits <= MAX_SPLITS
extern "C" __global__ void __launch_bounds__(WARPS * 32, MINB)
attn_decode(const float* __restrict__ q, const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache,
            const DecodeState* __restrict__ st, float* pm, float* pl, float* pacc, float* __restrict__ out,
            unsigned* counters, int max_ctx, float scale2, int min_chunk)
{
    // the position is the previous step's: no kernel of this step writes it
    const int splits = gridDim.x, split = blockIdx.x, kvh = blockIdx.y;
    const int nkv = min(max(st->pos, 0) + 1, max_ctx);
    const int active = min(splits, (nkv + min_chunk - 1) / min_chunk);
    if (split >= active) return;
    const int chunk = (nkv + active - 1) / active;
    const int lo = min(split * chunk, nkv), hi = min(lo + chunk, nkv);
    __shared__ Merged sm;
    __shared__ bool last;
    attend(q, k_cache, v_cache, kvh, lo, hi, nkv - 1, max_ctx, scale2, sm);
    if (active == 1) {
        for (int t = threadIdx.x; t < G * HD; t += WARPS * 32) {
            const int g = t / HD, e = t % HD;
            float m, l;
            const float o = merged(sm, g, e, m, l);
            out[((size_t)kvh * G + g) * HD + e] = o * __frcp_rn(l);
        }
        return;
    }
    store_partials(sm, kvh, split, splits, pm, pl, pacc);
    // the block's writes, then its count (as a cooperative grid sync orders them)
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(counters + kvh, 1u) == (unsigned)active - 1;
        __threadfence();
    }
    __syncthreads();
    if (!last) return;
    combine(pm, pl, pacc, out, kvh, splits, active, sm);
    if (threadIdx.x == 0) counters[kvh] = 0;
}
