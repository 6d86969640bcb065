// dev/attn_oproj_ab.py: how much o_proj would give back folded into attention, for the small shapes. The one-split
// path of kernels/attention.cu (a block per query head over every cached row), then the block multiplies its head's
// output by that head's columns of W_o: no o_proj launch, no phase between attention and gate_up. The hidden_size
// results reach x in one of two ways:
//   SUM_LAST 0: red.add into x. The adds land in any order, so the bits vary from run to run: this measures what
//     the fold is worth, not a kernel the step could run.
//   SUM_LAST 1: each block stores its results as its head's partial; the last block to count (an acquire-release
//     add, as attention's merge) adds them to x in head order, the same bits every run, at the cost of that count
//     and one block's pass over every partial.
// The columns (hidden rows of HEAD_DIM bf16, padded by 16 bytes a row so that 8 lanes' 16-byte reads meet no
// bank twice) are copied into shared memory before the PDL wait. Same defines as attention.cu, ONE_SPLIT_HEADS 1;
// cached rows past one_split_rows are not handled (the script keeps to depth 0). Grid (GROUP, kv heads).
#include "attention.cu"

#ifndef SUM_LAST
#define SUM_LAST 0
#endif

static_assert(ONE_SPLIT_HEADS == 1, "a block per query head");
constexpr int W_ROW = HEAD_DIM / 8 + 1;  // uint4 per padded row of the head's W_o columns

__device__ __forceinline__ void copy16(void* dst, const void* src) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
}

// wo: [hidden, nh * HEAD_DIM] bf16 (o_proj); x: [hidden] f32, += W_o attn; partials: [nh, hidden] f32 and
// count: one word, zero between launches (SUM_LAST)
extern "C" __global__ void __launch_bounds__(WARPS * 32, 1)
attn_oproj(const float* __restrict__ q, const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache,
           const DecodeState* __restrict__ st, float* pm, float* pl, float* pacc, float* __restrict__ out,
           unsigned* counters, int max_ctx, float scale2, int min_chunk, int one_split_rows,
           const bf16* __restrict__ wo, float* __restrict__ x, int hidden, float* partials, unsigned* count)
{
    const int split = blockIdx.x, kvh = blockIdx.y;
    if (split >= GROUP) return;
    const int head = kvh * GROUP + split, nh = gridDim.y * GROUP;
    extern __shared__ uint4 wsm[];
    for (int i = threadIdx.x; i < hidden * (HEAD_DIM / 8); i += WARPS * 32) {
        const int r = i / (HEAD_DIM / 8), c = i % (HEAD_DIM / 8);
        copy16(wsm + r * W_ROW + c, wo + ((size_t)r * nh + head) * HEAD_DIM + c * 8);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
    const int n_cached = min(max(__ldcg(&st->pos), 0) + 1, max_ctx);
    __shared__ Merged sm;
    __shared__ float o[HEAD_DIM];
    attend<1>(q, k_cache, v_cache, kvh, split, 0, n_cached, n_cached - 1, max_ctx, scale2, sm);
    for (int e = threadIdx.x; e < HEAD_DIM; e += WARPS * 32) {
        float m, l;
        const float v = merged(sm, 0, e, m, l);
        o[e] = v * __frcp_rn(l);
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();
    for (int r = threadIdx.x; r < hidden; r += WARPS * 32) {
        float acc = 0.f;
#pragma unroll
        for (int c = 0; c < HEAD_DIM / 8; ++c) {
            float wf[8];
            unpack8(wsm[r * W_ROW + c], wf);
#pragma unroll
            for (int e = 0; e < 8; ++e) acc = fmaf(wf[e], o[c * 8 + e], acc);
        }
        if (SUM_LAST)
            partials[(size_t)head * hidden + r] = acc;
        else
            atomicAdd(x + r, acc);
    }
    if (!SUM_LAST) return;
    __shared__ bool last;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned before;
        asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(before) : "l"(count) : "memory");
        last = before == (unsigned)nh - 1;
    }
    __syncthreads();
    if (!last) return;
    for (int r = threadIdx.x; r < hidden; r += WARPS * 32) {
        float v = x[r];
        for (int h = 0; h < nh; ++h) v += __ldcg(partials + (size_t)h * hidden + r);
        x[r] = v;
    }
    if (threadIdx.x == 0) *count = 0;
}
