// Picks the next token on the device and advances the decode state, one block.
// While pos + 1 < prompt_len the next token is the prompt's (prefill by replay). Otherwise greedy
// argmax (lowest index on ties) at temperature 0, else z = logits / T, top-k, top-p, Gumbel-max with
// the counter-based RNG, as engine/sampling.py defines them. Thresholds are found by bisection on
// order-preserving float keys over the candidates z >= max - CUT, compacted in index order into
// shared memory (or the global scratch when there are more than CAP): with 24-bit uniforms the
// Gumbel noise spans less than 21, so nothing below the cut can win. When more than CAP pass the
// cut and top-k keeps at most CAP, a radix select finds the top-k threshold in three passes and
// only the values at or above it are compacted, so the bisections run over few candidates.
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

// the key of the k-th largest of z[0, n) (the largest t with #{key_of(z) >= t} >= k), 1 <= k <= n:
// radix select on 11, 11 and 10 key bits, a histogram per pass with warp-aggregated atomics
__device__ unsigned select_key(const float* z, int n, int k, int* hist, Scratch& s) {
    __shared__ int pick_bin, pick_above;
    unsigned prefix = 0, mask = 0;
    int need = k;
#pragma unroll
    for (int pass = 0; pass < 3; ++pass) {
        const int shift = pass == 0 ? 21 : pass == 1 ? 10 : 0;
        const int bins = pass == 2 ? 1024 : 2048;
        for (int b = threadIdx.x; b < 2048; b += BLOCK) hist[b] = 0;
        __syncthreads();
        for (int base = 0; base < n; base += BLOCK) {
            const int j = base + threadIdx.x;
            const unsigned key = j < n ? key_of(z[j]) : 0u;
            const bool in = j < n && (key & mask) == prefix;
            const unsigned bin = in ? (key >> shift) & (unsigned)(bins - 1) : 0xffffffffu;
            const unsigned peers = __match_any_sync(0xffffffffu, bin);
            if (in && (int)(threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(hist + bin, __popc(peers));
        }
        __syncthreads();
        // bins from the top, two per thread: the one where the count from the top reaches need
        const int r = 2 * threadIdx.x;
        const int c0 = r < bins ? hist[bins - 1 - r] : 0;
        const int c1 = r + 1 < bins ? hist[bins - 2 - r] : 0;
        int total;
        const int before = block_scan(c0 + c1, &total, s);
        if (before < need && need <= before + c0) {
            pick_bin = bins - 1 - r;
            pick_above = before;
        } else if (before + c0 < need && need <= before + c0 + c1) {
            pick_bin = bins - 2 - r;
            pick_above = before + c0;
        }
        __syncthreads();
        prefix |= (unsigned)pick_bin << shift;
        mask |= (unsigned)(bins - 1) << shift;
        need -= pick_above;
        __syncthreads();
    }
    return prefix;
}

// z[j], idx[j] with key_of(z[j]) >= t, in order, into out_z, out_i; returns how many
__device__ int compact_ge(const float* z, const int* idx, int n, unsigned t, float* out_z, int* out_i, Scratch& s) {
    int done = 0;
    for (int base = 0; base < n; base += 4 * BLOCK) {
        float v[4];
        int id[4], k = 0;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int j = base + 4 * threadIdx.x + e;
            v[e] = j < n ? z[j] : NEG_INF;
            id[e] = j < n ? idx[j] : 0;
            k += j < n && key_of(v[e]) >= t;
        }
        int total;
        int at = done + block_scan(k, &total, s);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int j = base + 4 * threadIdx.x + e;
            if (j < n && key_of(v[e]) >= t) {
                out_z[at] = v[e];
                out_i[at] = id[e];
                ++at;
            }
        }
        done += total;
    }
    __syncthreads();
    return done;
}

// lmax: the largest logit (division by temp > 0 keeps the order and rounds monotonically)
__device__ int draw(const float* __restrict__ logits, const DecodeState* st, float temp, float lmax, float* cz,
                    int* ci, float* gz, int* gi, int* hist, int vocab, Scratch& s) {
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
    int n = block_sum_int(c, s);
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
    bool selected = false;
    if (n > CAP && top_k > 0 && top_k <= CAP) {
        // too many candidates for shared memory, but top-k keeps few: find its threshold directly,
        // and keep only z >= it when they fit
        tk = select_key(z, n, top_k, hist, s);
        const int kept = count_ge(z, n, tk, s);
        if (kept <= CAP) {
            n = compact_ge(z, idx, n, tk, cz, ci, s);
            z = cz;
            idx = ci;
        }
        selected = true;
    }
    if (top_k > 0 && top_k < vocab) {
        if (n >= top_k && !selected) {
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
    __shared__ int hist[2048];
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
        next = draw(logits, st, temp, val_of((unsigned)(best >> 32)), cz, ci, scratch_z, scratch_i, hist, vocab, s);
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
