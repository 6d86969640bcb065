// Per-token kernels of batched prefill over a chunk: row t of every buffer is position pos0 + t.
// Embedding gather, RMSNorm to bf16 (the GEMM input), bias + q/k RMSNorm + RoPE with the K/V
// append, and the SiLU gate. Grids cover the whole chunk and rows t >= T return at once, so the
// launches are built once and only (pos0, T), the first two arguments, change per chunk.
// Defines: HEAD_DIM, QK_NORM and BIAS (0/1, rope_rows only), WARPS (rows or heads per block).
// budget: embed_rows=32 rms_rows=40 rope_rows=64 silu_rows=32
// defines: HEAD_DIM=128 QK_NORM=0 BIAS=0 WARPS=4
// defines: HEAD_DIM=64 QK_NORM=0 BIAS=1 WARPS=4
// defines: HEAD_DIM=16 QK_NORM=1 BIAS=0 WARPS=8
#include "common.cuh"

#if !defined(HEAD_DIM) || !defined(QK_NORM) || !defined(BIAS) || !defined(WARPS)
#error "prefill_rope.cu needs HEAD_DIM, QK_NORM, BIAS and WARPS"
#endif
#define HALF (HEAD_DIM / 2)
#define PAIRS_PER_LANE ((HALF + 31) / 32)  // rotate-half pairs (x[i], x[i + HALF]) per lane

static_assert(HEAD_DIM % 16 == 0 && HEAD_DIM <= 256, "head_dim must be a multiple of 16, at most 256");

// table: [vocab, hidden] bf16; prompt: [max_ctx] token of each position; x: [C, hidden] f32.
// grid (C, ceil(hidden / 8 / blockDim))
extern "C" __global__ void embed_rows(int pos0, int T, const bf16* __restrict__ table,
                                      const int* __restrict__ prompt, float* __restrict__ x, int vocab, int hidden)
{
    const int t = blockIdx.x, i = blockIdx.y * blockDim.x + threadIdx.x;
    if (t >= T || i >= hidden / 8) return;
    const int tok = min(max(prompt[pos0 + t], 0), vocab - 1);
    float f[8];
    unpack8(reinterpret_cast<const uint4*>(table + (size_t)tok * hidden)[i], f);
    float4* out = reinterpret_cast<float4*>(x + (size_t)t * hidden) + 2 * i;
    out[0] = make_float4(f[0], f[1], f[2], f[3]);
    out[1] = make_float4(f[4], f[5], f[6], f[7]);
}

// out[t] = bf16(x[t] / rms(x[t]) * gamma); one warp per row. x: [C, hidden] f32; out: [C, hidden] bf16
extern "C" __global__ void __launch_bounds__(WARPS * 32)
rms_rows(int pos0, int T, const float* __restrict__ x, const float* __restrict__ gamma, bf16* __restrict__ out,
         int hidden, float eps)
{
    const int lane = threadIdx.x & 31, t = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (t >= T) return;
    const float4* row = reinterpret_cast<const float4*>(x + (size_t)t * hidden);
    const float4* g4 = reinterpret_cast<const float4*>(gamma);
    float ss = 0.f;
    for (int i = lane; i < hidden / 4; i += 32) {
        const float4 v = row[i];
        ss = fmaf(v.x, v.x, fmaf(v.y, v.y, fmaf(v.z, v.z, fmaf(v.w, v.w, ss))));
    }
    const float r = 1.0f / sqrtf(warp_sum(ss) / (float)hidden + eps);
    uint2* dst = reinterpret_cast<uint2*>(out + (size_t)t * hidden);
    for (int i = lane; i < hidden / 4; i += 32) {
        const float4 v = row[i], g = g4[i];
        dst[i] = make_uint2(pack_bf2(v.x * r * g.x, v.y * r * g.y), pack_bf2(v.z * r * g.z, v.w * r * g.w));
    }
}

// One warp per (token, head): heads [0, nh) are q heads, written rotated and scaled by qscale to
// q_out [C, nh * HEAD_DIM] bf16; heads [nh, nh + kv_heads) rotate a k head and copy its v head into
// the cache row pos0 + t of this layer's k_cache, v_cache [kv_heads, max_ctx, HEAD_DIM] bf16.
// qkv: [C, nh*HEAD_DIM | kv_heads*HEAD_DIM | kv_heads*HEAD_DIM] f32;
// bias: [nh*HEAD_DIM + 2 kv_heads*HEAD_DIM] (BIAS); q_norm, k_norm: [HEAD_DIM] (QK_NORM)
// grid (C, ceil((nh + kv_heads) / WARPS))
extern "C" __global__ void __launch_bounds__(WARPS * 32)
rope_rows(int pos0, int T, const float* __restrict__ qkv, const float* __restrict__ bias,
          const float* __restrict__ q_norm, const float* __restrict__ k_norm, const float* __restrict__ cos_t,
          const float* __restrict__ sin_t, bf16* __restrict__ q_out, bf16* __restrict__ k_cache,
          bf16* __restrict__ v_cache, int nh, int kv_heads, int max_ctx, float eps, float qscale)
{
    const int lane = threadIdx.x & 31, t = blockIdx.x;
    const int head = blockIdx.y * WARPS + (threadIdx.x >> 5);
    if (t >= T || head >= nh + kv_heads) return;
    const bool is_k = head >= nh;
    const int pos = pos0 + t;
    const size_t row = (size_t)t * (nh + 2 * kv_heads) * HEAD_DIM;
    const float* src = qkv + row + (size_t)head * HEAD_DIM;
    const float* bsrc = bias + (size_t)head * HEAD_DIM;
    float a[PAIRS_PER_LANE], b[PAIRS_PER_LANE];
#pragma unroll
    for (int j = 0; j < PAIRS_PER_LANE; ++j) {
        const int i = lane + 32 * j;
        a[j] = i < HALF ? src[i] + (BIAS ? bsrc[i] : 0.f) : 0.f;
        b[j] = i < HALF ? src[i + HALF] + (BIAS ? bsrc[i + HALF] : 0.f) : 0.f;
    }
    if (QK_NORM) head_rms_norm<HEAD_DIM>(a, b, is_k ? k_norm : q_norm, eps, lane);
    const size_t crow = ((size_t)(head - nh) * max_ctx + pos) * HEAD_DIM;
    bf16* qdst = q_out + ((size_t)t * nh + head) * HEAD_DIM;
    const float* vsrc = qkv + row + (size_t)(kv_heads + head) * HEAD_DIM;
    const float* vb = bias + (size_t)(kv_heads + head) * HEAD_DIM;
#pragma unroll
    for (int j = 0; j < PAIRS_PER_LANE; ++j) {
        const int i = lane + 32 * j;
        if (i >= HALF) continue;
        rotate_pair(a[j], b[j], cos_t[(size_t)pos * HALF + i], sin_t[(size_t)pos * HALF + i]);
        if (!is_k) {
            qdst[i] = f2bf(a[j] * qscale);
            qdst[i + HALF] = f2bf(b[j] * qscale);
        } else {
            k_cache[crow + i] = f2bf(a[j]);
            k_cache[crow + i + HALF] = f2bf(b[j]);
            v_cache[crow + i] = f2bf(vsrc[i] + (BIAS ? vb[i] : 0.f));
            v_cache[crow + i + HALF] = f2bf(vsrc[i + HALF] + (BIAS ? vb[i + HALF] : 0.f));
        }
    }
}

// act[t, i] = bf16(silu(gu[t, i]) * gu[t, inter + i]); gu: [C, 2 inter] f32 (gate | up);
// act: [C, inter] bf16. A grid-stride loop over the T * inter / 4 float4 groups
extern "C" __global__ void silu_rows(int pos0, int T, const float* __restrict__ gu, bf16* __restrict__ act,
                                     int inter)
{
    const int q = inter / 4;
    const int n = T * q;
    for (int idx = blockIdx.x * blockDim.x + threadIdx.x; idx < n; idx += gridDim.x * blockDim.x) {
        const int t = idx / q, c = idx - t * q;
        const float4 g = reinterpret_cast<const float4*>(gu + (size_t)t * 2 * inter)[c];
        const float4 u = reinterpret_cast<const float4*>(gu + (size_t)t * 2 * inter + inter)[c];
        reinterpret_cast<uint2*>(act + (size_t)t * inter)[c] =
            make_uint2(pack_bf2(g.x / (1.0f + expf(-g.x)) * u.x, g.y / (1.0f + expf(-g.y)) * u.y),
                       pack_bf2(g.z / (1.0f + expf(-g.z)) * u.z, g.w / (1.0f + expf(-g.w)) * u.w));
    }
}
