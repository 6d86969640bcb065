// Split-KV decode attention, combine pass: one warp per head merges the split partials in the
// base-2 domain, lse_s = m_s + log2(l_s), out = sum_s 2^(lse_s - max) acc_s / l_s / sum_s 2^(lse_s - max).
// budget: attn_combine=40
// defines: HD=128
// defines: HD=64
// defines: HD=16
#include "common.cuh"

#ifndef WARPS
#define WARPS 4
#endif
#define VEC (HD / 4)
#define PER ((VEC + 31) / 32)

static_assert(HD % 4 == 0, "head_dim must be a multiple of 4");

// pm, pl: [nh, splits]; pacc: [nh, splits, HD]; out: [nh*HD]
extern "C" __global__ void __launch_bounds__(WARPS * 32)
attn_combine(const float* __restrict__ pm, const float* __restrict__ pl, const float* __restrict__ pacc,
             float* __restrict__ out, int nh, int splits)
{
    pdl_enter();
    const int lane = threadIdx.x & 31;
    const int head = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (head >= nh) return;
    const float* m = pm + (size_t)head * splits;
    const float* l = pl + (size_t)head * splits;
    float big = NEG_INF;
    for (int s = lane; s < splits; s += 32)
        if (l[s] > 0.f) big = fmaxf(big, m[s] + log2f(l[s]));
    big = warp_max(big);
    float den = 0.f;
    float4 num[PER];
#pragma unroll
    for (int j = 0; j < PER; ++j) num[j] = make_float4(0.f, 0.f, 0.f, 0.f);
    const float4* acc = reinterpret_cast<const float4*>(pacc + (size_t)head * splits * HD);
    for (int s = 0; s < splits; ++s) {
        const float ls = l[s];
        if (!(ls > 0.f)) continue;
        const float w = exp2f(m[s] + log2f(ls) - big);
        const float f = w * __frcp_rn(ls);
        den += w;
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            const int c = lane + 32 * j;
            if (c >= VEC) continue;
            const float4 a = acc[(size_t)s * VEC + c];
            num[j].x = fmaf(f, a.x, num[j].x);
            num[j].y = fmaf(f, a.y, num[j].y);
            num[j].z = fmaf(f, a.z, num[j].z);
            num[j].w = fmaf(f, a.w, num[j].w);
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
