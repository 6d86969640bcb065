// Split-KV decode attention, combine pass: one warp per head merges the split partials in the
// base-2 domain, lse_s = m_s + log2(l_s), out = sum_s 2^(lse_s - max) acc_s / l_s / sum_s 2^(lse_s - max).
// Lanes weigh the splits in parallel; the accumulation then streams every split's row with no
// branch (an empty split has weight 0 and acc 0), several loads in flight.
// budget: attn_combine=64
// defines: HD=128
// defines: HD=64
// defines: HD=16
#include "common.cuh"

#ifndef WARPS
#define WARPS 4
#endif
#ifndef MAX_SPLITS
#define MAX_SPLITS 128
#endif
#define BATCH 8
#define VEC (HD / 4)
#define PER ((VEC + 31) / 32)

static_assert(HD % 4 == 0, "head_dim must be a multiple of 4");

// pm, pl: [nh, splits]; pacc: [nh, splits, HD]; out: [nh*HD]; splits <= MAX_SPLITS
extern "C" __global__ void __launch_bounds__(WARPS * 32, 1)
attn_combine(const float* __restrict__ pm, const float* __restrict__ pl, const float* __restrict__ pacc,
             float* __restrict__ out, int nh, int splits)
{
    pdl_enter();
    __shared__ float weight[WARPS][MAX_SPLITS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int head = blockIdx.x * WARPS + warp;
    if (head >= nh) return;
    const float* m = pm + (size_t)head * splits;
    const float* l = pl + (size_t)head * splits;
    float big = NEG_INF;
    for (int s = lane; s < splits; s += 32)
        if (l[s] > 0.f) big = fmaxf(big, m[s] + log2f(l[s]));
    big = warp_max(big);
    float den = 0.f;
    for (int s = lane; s < splits; s += 32) {
        const float ls = l[s];
        const float w = ls > 0.f ? exp2f(m[s] + log2f(ls) - big) : 0.f;
        den += w;
        weight[warp][s] = ls > 0.f ? w * __frcp_rn(ls) : 0.f;
    }
    den = warp_sum(den);
    __syncwarp();
    float4 num[PER];
#pragma unroll
    for (int j = 0; j < PER; ++j) num[j] = make_float4(0.f, 0.f, 0.f, 0.f);
    const float4* acc = reinterpret_cast<const float4*>(pacc + (size_t)head * splits * HD);
    for (int s0 = 0; s0 < splits; s0 += BATCH) {
        float4 a[BATCH][PER];
#pragma unroll
        for (int b = 0; b < BATCH; ++b)
#pragma unroll
            for (int j = 0; j < PER; ++j) {
                const int c = lane + 32 * j;
                a[b][j] = s0 + b < splits && c < VEC ? __ldg(acc + (size_t)(s0 + b) * VEC + c)
                                                      : make_float4(0.f, 0.f, 0.f, 0.f);
            }
#pragma unroll
        for (int b = 0; b < BATCH; ++b) {
            const float f = s0 + b < splits ? weight[warp][s0 + b] : 0.f;
#pragma unroll
            for (int j = 0; j < PER; ++j) {
                num[j].x = fmaf(f, a[b][j].x, num[j].x);
                num[j].y = fmaf(f, a[b][j].y, num[j].y);
                num[j].z = fmaf(f, a[b][j].z, num[j].z);
                num[j].w = fmaf(f, a[b][j].w, num[j].w);
            }
        }
    }
    const float inv = __frcp_rn(den);
    float4* o = reinterpret_cast<float4*>(out + (size_t)head * HD);
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int c = lane + 32 * j;
        if (c < VEC) o[c] = make_float4(num[j].x * inv, num[j].y * inv, num[j].z * inv, num[j].w * inv);
    }
}
