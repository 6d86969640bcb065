#pragma once
// Shared device helpers: bf16 unpacking, streaming loads, warp/block reductions, decode state.

typedef unsigned short bf16;

#define NEG_INF (-__int_as_float(0x7f800000))

// per-step state the graph reads and advances. The host writes it whole, between requests, from one
// function (graphs/buffers.py state_record, whose STATE_DTYPE mirrors this layout); on the device only
// the sampler writes it.
struct DecodeState {
    int token;          // token processed by this step
    int pos;            // its position; the sampler advances it
    int prompt_len;     // while pos + 1 < prompt_len the next token comes from the prompt
    int ring_mask;      // the host rings of sampled tokens and log-probabilities have ring_mask + 1 slots
    unsigned long long step;  // sampling counter: tokens sampled so far
    unsigned long long seed;
    float temperature;  // 0 = greedy
    int top_k;          // 0 = off
    float top_p;        // 1 = off
    float min_p_log;    // log(min_p): keep z - max z >= it; -inf = off
    float repeat_penalty;
    int repeat_last_n;  // tokens of the context the repeat penalty covers; -1: all of it
    float presence_penalty;
    float frequency_penalty;
    int logprobs;       // top-n log-probabilities per token; -1 = off
    unsigned flags;     // STATE_REPEAT, STATE_COUNTS from the host; STATE_NONFINITE from the sampler
};

#define STATE_REPEAT 1u     // the repeat penalty is on
#define STATE_COUNTS 2u     // the presence/frequency penalties are on
#define STATE_NONFINITE 4u  // a step's logits were not finite (sticky until the next request)

// the field offsets are checked against STATE_DTYPE by tests/test_state.py, which parses this struct
static_assert(sizeof(DecodeState) == 72, "graphs/buffers.py STATE_DTYPE has 72 bytes");

// under programmatic dependent launch: wait for the previous kernel's writes, then let the next
// kernel's blocks start launching; both are no-ops in a plain launch. Code before the wait may
// read only what no kernel of the step writes (weights). Code after it reads what the step writes with
// coherent loads only: ptxas schedules non-coherent (.nc, __ldg) loads across the wait, above it where no
// launch_dependents sits between (tests/test_pdl_schedule.py checks the machine code). PDL_TRIGGER_FIRST
// (Tuning.trigger_first) lets the next kernel launch first and then waits.
#ifndef PDL_TRIGGER_FIRST
#define PDL_TRIGGER_FIRST 0
#endif
__device__ __forceinline__ void pdl_enter() {
    if (PDL_TRIGGER_FIRST) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
    if (!PDL_TRIGGER_FIRST) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// the two halves of pdl_enter, for a kernel that reads nothing the previous kernel writes (gemv_core.cuh
// LATE_WAIT): it lets the next kernel launch at once and waits for the previous one only before it ends
__device__ __forceinline__ void pdl_launch() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// as ld_stream, but a coherent load: ptxas hoists the PDL wait above non-coherent (.nc) loads only,
// so weights read this way before pdl_enter really stream ahead of it
__device__ __forceinline__ uint4 ld_early(const uint4* p) {
    uint4 r;
    asm volatile("ld.global.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

__device__ __forceinline__ float bf_lo(unsigned w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf_hi(unsigned w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ float bf2f(bf16 b) { return __uint_as_float(((unsigned)b) << 16); }

// round to nearest even, NaN stays NaN
__device__ __forceinline__ bf16 f2bf(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

__device__ __forceinline__ unsigned pack_bf2(float lo, float hi) {
    return (unsigned)f2bf(lo) | ((unsigned)f2bf(hi) << 16);
}

// 8 bf16 -> 8 floats
__device__ __forceinline__ void unpack8(const uint4 w, float (&f)[8]) {
    f[0] = bf_lo(w.x); f[1] = bf_hi(w.x);
    f[2] = bf_lo(w.y); f[3] = bf_hi(w.y);
    f[4] = bf_lo(w.z); f[5] = bf_hi(w.z);
    f[6] = bf_lo(w.w); f[7] = bf_hi(w.w);
}

// weights are read once per step: keep them out of L1
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

// order-preserving uint32 key of a float (-0 and +0 share one key)
__device__ __forceinline__ unsigned key_of(float z) {
    const unsigned u = __float_as_uint(z + 0.0f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float val_of(unsigned k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// argmax packed for atomicMax: the larger value wins, then the lower index
__device__ __forceinline__ unsigned long long argmax_key(float v, int i) {
    return ((unsigned long long)key_of(v) << 32) | (0xffffffffu - (unsigned)i);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// 2^x by the hardware approximation (what exp2f becomes under fast math); 0 for x = -inf
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// sum over the `width` lanes of an aligned lane group (width a power of two)
template <int WIDTH>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
    for (int o = WIDTH / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// RoPE of one rotate-half pair (a = x[i], b = x[i + D/2]) at angle (cos cf, sin sf), in place
__device__ __forceinline__ void rotate_pair(float& a, float& b, float cf, float sf) {
    const float lo = a * cf - b * sf;
    b = b * cf + a * sf;
    a = lo;
}

// RMSNorm of one head held by a warp as rotate-half pairs: lane owns a[j] = x[lane + 32j] and
// b[j] = x[lane + 32j + D/2] (Qwen3's q/k norm, applied before RoPE)
template <int D, int N>
__device__ __forceinline__ void head_rms_norm(float (&a)[N], float (&b)[N], const float* g, float eps,
                                              int lane) {
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < N; ++j) ss = fmaf(a[j], a[j], fmaf(b[j], b[j], ss));
    const float r = 1.0f / sqrtf(warp_sum(ss) / (float)D + eps);
#pragma unroll
    for (int j = 0; j < N; ++j) {
        const int i = lane + 32 * j;
        if (i < D / 2) {
            a[j] = a[j] * r * g[i];
            b[j] = b[j] * r * g[i + D / 2];
        }
    }
}
