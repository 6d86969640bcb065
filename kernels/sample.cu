// Picks the next token on the device and advances the decode state, one block.
// While pos + 1 < prompt_len the next token is the prompt's (prefill by replay). Otherwise greedy
// argmax (lowest index on ties) at temperature 0, else z = logits / T, top-k, top-p, Gumbel-max with
// the counter-based RNG, as engine/sampling.py defines them. Thresholds are found by bisection on
// order-preserving float keys over the candidates z >= max - CUT, compacted in index order into
// shared memory (or the global scratch when there are more than CAP): with 24-bit uniforms the
// Gumbel noise spans less than 21, so nothing below the cut can win.
// budget: sample=64
// defines: BLOCK=1024 CAP=4096
#include "reduce.cuh"

#define CUT 24.0f
#define NO_CUT 0x7fffffff

__device__ __forceinline__ float rng_u(unsigned long long seed, unsigned long long step, unsigned long long i) {
    unsigned long long x = seed * 0x9E3779B97F4A7C15ull + step * 0xD1B54A32D192ED03ull + i;
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBull;
    x ^= x >> 31;
    return fminf(__fadd_rn((float)(x >> 40), 0.5f) * 0x1p-24f, 0x1.fffffep-1f);
}

__device__ __forceinline__ float log_rn(float x) { return (float)log((double)x); }

__device__ int count_ge(const float* z, int n, unsigned t, Scratch& s) {
    int c = 0;
#pragma unroll 4
    for (int j = threadIdx.x; j < n; j += BLOCK) c += key_of(z[j]) >= t;
    return block_sum_int(c, s);
}

__device__ float mass_ge(const float* z, int n, unsigned t, float m, Scratch& s) {
    float a = 0.f;
#pragma unroll 4
    for (int j = threadIdx.x; j < n; j += BLOCK)
        if (key_of(z[j]) >= t) a += expf(z[j] - m);
    return block_sum(a, s);
}

// ties at key t with index <= c
__device__ int count_tied(const float* z, const int* idx, int n, unsigned t, int c, Scratch& s) {
    int k = 0;
#pragma unroll 4
    for (int j = threadIdx.x; j < n; j += BLOCK) k += key_of(z[j]) == t && idx[j] <= c;
    return block_sum_int(k, s);
}

// lmax: the largest logit (division by temp > 0 keeps the order and rounds monotonically)
__device__ int draw(const float* __restrict__ logits, const DecodeState* st, float temp, float lmax, float* cz,
                    int* ci, float* gz, int* gi, int vocab, Scratch& s) {
    const float m = __fdiv_rn(lmax, temp);
    const float cut = m - CUT;
    int c = 0;
    float sa = 0.f;
#pragma unroll 8
    for (int i = threadIdx.x; i < vocab; i += BLOCK) {
        const float zi = __fdiv_rn(logits[i], temp);
        c += zi >= cut;
        sa += expf(zi - m);
    }
    const int n = block_sum_int(c, s);
    const float s_all = block_sum(sa, s);
    float* z = n <= CAP ? cz : gz;
    int* idx = n <= CAP ? ci : gi;

    // compaction in index order: each tile gives thread t the 4 elements from 4t
    int done = 0;
    for (int base = 0; base < vocab; base += 4 * BLOCK) {
        float v[4];
        int k = 0;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int i = base + 4 * threadIdx.x + e;
            v[e] = i < vocab ? __fdiv_rn(logits[i], temp) : NEG_INF;
            k += i < vocab && v[e] >= cut;
        }
        int total;
        int at = done + block_scan(k, &total, s);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int i = base + 4 * threadIdx.x + e;
            if (i < vocab && v[e] >= cut) {
                z[at] = v[e];
                idx[at] = i;
                ++at;
            }
        }
        done += total;
    }
    __syncthreads();

    const unsigned kmax = key_of(m);
    unsigned tk = key_of(cut);
    float sk = s_all;
    const int top_k = st->top_k;
    if (top_k > 0 && top_k < vocab) {
        if (n >= top_k) {
            unsigned lo = tk, hi = kmax;
            while (lo < hi) {
                const unsigned mid = lo + (unsigned)(((unsigned long long)hi - lo + 1) >> 1);
                if (count_ge(z, n, mid, s) >= top_k) lo = mid;
                else hi = mid - 1;
            }
            tk = lo;
        }
        sk = mass_ge(z, n, tk, m, s);
    }

    unsigned tp = 0;
    int icut = NO_CUT;
    const float top_p = st->top_p;
    if (top_p < 1.f) {
        const float target = top_p * sk;
        if (count_ge(z, n, tk, s) > 1 && mass_ge(z, n, tk, m, s) >= target) {
            unsigned lo = tk, hi = kmax;
            while (lo < hi) {
                const unsigned mid = lo + (unsigned)(((unsigned long long)hi - lo + 1) >> 1);
                if (mass_ge(z, n, mid, m, s) >= target) lo = mid;
                else hi = mid - 1;
            }
            tp = lo;
            const int ties = count_tied(z, idx, n, tp, vocab, s);
            if (ties > 1) {
                // the prefix ends inside the tie group: keep its lowest indices first
                const float above = mass_ge(z, n, tp + 1, m, s);
                const float e = expf(val_of(tp) - m);
                const int need = min(max((int)ceilf((target - above) / e), 1), ties);
                int a = 0, b = vocab - 1;
                while (a < b) {
                    const int mid = (a + b) >> 1;
                    if (count_tied(z, idx, n, tp, mid, s) >= need) b = mid;
                    else a = mid + 1;
                }
                icut = a;
            }
        }
    }

    const unsigned long long seed = st->seed, step = st->step;
    float best = NEG_INF;
    int bi = NO_CUT;
    for (int j = threadIdx.x; j < n; j += BLOCK) {
        const unsigned k = key_of(z[j]);
        if (k < tk || k < tp || (k == tp && idx[j] > icut)) continue;
        const float g = z[j] - log_rn(-log_rn(rng_u(seed, step, (unsigned long long)idx[j])));
        better(best, bi, g, idx[j]);
    }
    return block_argmax(best, bi, s);
}

// logits: [vocab] f32; amax: argmax_key of the logits, folded in by the lm_head GEMV, reset here;
// prompt: [max_ctx]; ring: host-mapped [ring_mask + 1]; scratch_z, scratch_i: [vocab], used when
// more than CAP candidates pass the cut
extern "C" __global__ void __launch_bounds__(BLOCK)
sample(const float* __restrict__ logits, unsigned long long* amax, DecodeState* st, const int* __restrict__ prompt,
       int* ring, float* scratch_z, int* scratch_i, int vocab, int max_ctx)
{
    __shared__ Scratch s;
    __shared__ float cz[CAP];
    __shared__ int ci[CAP];
    pdl_enter();
    const int pos = st->pos;
    const float temp = st->temperature;
    const bool in_prompt = pos + 1 < st->prompt_len;
    const unsigned long long best = *amax;
    int next;
    if (in_prompt) {
        next = prompt[pos + 1];
    } else if (!(temp > 0.f)) {
        next = best ? (int)(0xffffffffu - (unsigned)best) : 0;
    } else {
        next = draw(logits, st, temp, val_of((unsigned)(best >> 32)), cz, ci, scratch_z, scratch_i, vocab, s);
    }
    next = min(max(next, 0), vocab - 1);
    __syncthreads();
    if (threadIdx.x == 0) {
        *amax = 0ull;
        st->token = next;
        st->pos = min(pos + 1, max_ctx);
        if (!in_prompt) st->step += 1;
        ring[pos & st->ring_mask] = next;
    }
}
