// Per-head q/k RMSNorm (Qwen3), rotate-half RoPE at the state's position, and the K/V append.
// One warp per head: warps [0, nh) take the q heads (rotated in place), warps [nh, nh + kv_heads)
// a k head and its v head, written as bf16 into the cache row min(pos, max_ctx - 1).
// Defines: HEAD_DIM, QK_NORM (0/1: apply the per-head norms), WARPS (heads per block).
// budget: rope_append=64
// defines: HEAD_DIM=128 QK_NORM=0 WARPS=4
// defines: HEAD_DIM=64 QK_NORM=1 WARPS=4
// defines: HEAD_DIM=16 QK_NORM=1 WARPS=8
#include "common.cuh"

#if !defined(HEAD_DIM) || !defined(QK_NORM) || !defined(WARPS)
#error "rope.cu needs HEAD_DIM, QK_NORM and WARPS"
#endif
#define HALF (HEAD_DIM / 2)
#define PAIRS_PER_LANE ((HALF + 31) / 32)  // rotate-half pairs (x[i], x[i + HALF]) per lane

static_assert(HEAD_DIM % 8 == 0 && HEAD_DIM <= 256, "head_dim must be a multiple of 8, at most 256");

// qkv: [nh*HEAD_DIM | kv_heads*HEAD_DIM | kv_heads*HEAD_DIM] f32; q_norm, k_norm: [HEAD_DIM] (QK_NORM);
// cos, sin: [max_ctx, HEAD_DIM/2]; k_cache, v_cache: this layer's [kv_heads, max_ctx, HEAD_DIM] bf16
extern "C" __global__ void __launch_bounds__(WARPS * 32)
rope_append(float* __restrict__ qkv, const float* __restrict__ q_norm, const float* __restrict__ k_norm,
            const float* __restrict__ cos_t, const float* __restrict__ sin_t, const DecodeState* __restrict__ st,
            bf16* __restrict__ k_cache, bf16* __restrict__ v_cache, int nh, int kv_heads, int max_ctx, float eps)
{
    pdl_enter();
    const int lane = threadIdx.x & 31;
    const int head = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (head >= nh + kv_heads) return;
    const bool is_k = head >= nh;
    const int pos = min(max(st->pos, 0), max_ctx - 1);
    float* src = qkv + (size_t)head * HEAD_DIM;
    float a[PAIRS_PER_LANE], b[PAIRS_PER_LANE];
#pragma unroll
    for (int j = 0; j < PAIRS_PER_LANE; ++j) {
        const int i = lane + 32 * j;
        a[j] = i < HALF ? src[i] : 0.f;
        b[j] = i < HALF ? src[i + HALF] : 0.f;
    }
    if (QK_NORM) head_rms_norm<HEAD_DIM>(a, b, is_k ? k_norm : q_norm, eps, lane);
    bf16* kdst = k_cache + ((size_t)(head - nh) * max_ctx + pos) * HEAD_DIM;
    bf16* vdst = v_cache + ((size_t)(head - nh) * max_ctx + pos) * HEAD_DIM;
    const float* vsrc = qkv + (size_t)(kv_heads + head) * HEAD_DIM;
#pragma unroll
    for (int j = 0; j < PAIRS_PER_LANE; ++j) {
        const int i = lane + 32 * j;
        if (i >= HALF) continue;
        rotate_pair(a[j], b[j], cos_t[(size_t)pos * HALF + i], sin_t[(size_t)pos * HALF + i]);
        if (!is_k) {
            src[i] = a[j];
            src[i + HALF] = b[j];
        } else {
            kdst[i] = f2bf(a[j]);
            kdst[i + HALF] = f2bf(b[j]);
            vdst[i] = f2bf(vsrc[i]);
            vdst[i + HALF] = f2bf(vsrc[i + HALF]);
        }
    }
}
