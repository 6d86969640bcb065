// Split-KV decode attention, partial pass. Grid (splits, kv heads): block (s, h) covers cache rows
// [s*chunk, min((s+1)*chunk, nkv)) with nkv = pos + 1 read from the decode state and
// chunk = ceil(nkv / splits), for the G query heads of kv head h, so each K/V row is loaded once.
// A row is HD/8 lanes wide (16 bytes each); a warp reads 32/(HD/8) rows at once, R times per step.
// Scores are in the base-2 domain (scale2 = scale * log2 e); an empty split writes m = -inf, l = 0.
// budget: attn_partial=224
// defines: HD=128 G=4
// defines: HD=128 G=8
// defines: HD=64 G=7
// defines: HD=16 G=3
#include "common.cuh"

#ifndef WARPS
#define WARPS 4
#endif
#ifndef R
#define R 2
#endif
#define LPR (HD / 8)
#define SLOTS (32 / LPR)
#define STEP (SLOTS * R)

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

// q: [nh*HD] f32 (after RoPE); k_cache, v_cache: this layer's [nkv_heads, max_ctx, HD] bf16;
// pm, pl: [nh, splits]; pacc: [nh, splits, HD] (unnormalised)
extern "C" __global__ void __launch_bounds__(WARPS * 32)
attn_partial(const float* __restrict__ q, const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache,
             const DecodeState* __restrict__ st, float* __restrict__ pm, float* __restrict__ pl,
             float* __restrict__ pacc, int max_ctx, float scale2)
{
    pdl_enter();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int splits = gridDim.x, split = blockIdx.x, kvh = blockIdx.y;
    const int slot = lane / LPR, sub = lane % LPR;
    const int nkv = min(max(st->pos, 0) + 1, max_ctx);
    const int chunk = (nkv + splits - 1) / splits;
    const int lo = min(split * chunk, nkv), hi = min(lo + chunk, nkv);

    float qf[G][8];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const float4* qp = reinterpret_cast<const float4*>(q + (size_t)(kvh * G + g) * HD + sub * 8);
        const float4 a = qp[0], b = qp[1];
        qf[g][0] = a.x; qf[g][1] = a.y; qf[g][2] = a.z; qf[g][3] = a.w;
        qf[g][4] = b.x; qf[g][5] = b.y; qf[g][6] = b.z; qf[g][7] = b.w;
    }
    Part p;
#pragma unroll
    for (int g = 0; g < G; ++g) {
        p.m[g] = NEG_INF;
        p.l[g] = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) p.o[g][e] = 0.f;
    }
    const uint4* kb = reinterpret_cast<const uint4*>(k_cache + (size_t)kvh * max_ctx * HD) + sub;
    const uint4* vb = reinterpret_cast<const uint4*>(v_cache + (size_t)kvh * max_ctx * HD) + sub;

    for (int base = lo + warp * STEP; base < hi; base += WARPS * STEP) {
        uint4 kk[R], vv[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int row = base + r * SLOTS + slot;
            kk[r] = row < hi ? __ldg(kb + (size_t)row * LPR) : make_uint4(0, 0, 0, 0);
            vv[r] = row < hi ? __ldg(vb + (size_t)row * LPR) : make_uint4(0, 0, 0, 0);
        }
        float s[R][G];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            float kf[8];
            unpack8(kk[r], kf);
            const bool ok = base + r * SLOTS + slot < hi;
#pragma unroll
            for (int g = 0; g < G; ++g) {
                float d = 0.f;
#pragma unroll
                for (int e = 0; e < 8; ++e) d = fmaf(qf[g][e], kf[e], d);
                d = group_sum<LPR>(d);
                s[r][g] = ok ? d * scale2 : NEG_INF;
            }
        }
        float vf[R][8];
#pragma unroll
        for (int r = 0; r < R; ++r) unpack8(vv[r], vf[r]);
#pragma unroll
        for (int g = 0; g < G; ++g) {
            float mx = s[0][g];
#pragma unroll
            for (int r = 1; r < R; ++r) mx = fmaxf(mx, s[r][g]);
            const float mn = fmaxf(p.m[g], mx);
            if (mn == NEG_INF) continue;
            const float corr = exp2f(p.m[g] - mn);
            float e2[R], sum = 0.f;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                e2[r] = exp2f(s[r][g] - mn);
                sum += e2[r];
            }
            p.l[g] = p.l[g] * corr + sum;
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                float o = p.o[g][e] * corr;
#pragma unroll
                for (int r = 0; r < R; ++r) o = fmaf(e2[r], vf[r][e], o);
                p.o[g][e] = o;
            }
            p.m[g] = mn;
        }
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
    __shared__ float sm_m[WARPS][G], sm_l[WARPS][G];
    __shared__ float sm_o[WARPS][G][HD];
    if (lane < LPR) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
#pragma unroll
            for (int e = 0; e < 8; ++e) sm_o[warp][g][sub * 8 + e] = p.o[g][e];
            if (lane == 0) {
                sm_m[warp][g] = p.m[g];
                sm_l[warp][g] = p.l[g];
            }
        }
    }
    __syncthreads();
    for (int t = threadIdx.x; t < G * HD; t += WARPS * 32) {
        const int g = t / HD, e = t % HD;
        float m = NEG_INF;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) m = fmaxf(m, sm_m[w][g]);
        float l = 0.f, o = 0.f;
        if (m != NEG_INF) {
#pragma unroll
            for (int w = 0; w < WARPS; ++w) {
                const float c = exp2f(sm_m[w][g] - m);
                l += sm_l[w][g] * c;
                o += sm_o[w][g][e] * c;
            }
        }
        const size_t head = (size_t)kvh * G + g;
        pacc[(head * splits + split) * HD + e] = o;
        if (e == 0) {
            pm[head * splits + split] = m;
            pl[head * splits + split] = l;
        }
    }
}
