// Picks the next token on the device and advances the decode state: BLOCKS blocks of BLOCK threads, block
// b over logits [b * SLICE, (b + 1) * SLICE), PER_THREAD per thread. The rule is engine/sampling.py's, bit for
// bit: penalties, then greedy or z = l / T; the "records" (the Gumbel winner over all tokens, then over
// the tokens above its z, ...) are found per warp and merged per block, a warp per range of z (the
// block's first warp's records cut the ranges); the last block to arrive merges every block's records
// into the overall ones (16 warps over every 16th block's list each, the lists gathered into registers,
// then a warp per range of z over their 16 lists) and hands them out; every block then counts the
// tokens and integer masses above each record's z (only what top-k and top-p need); the last block to
// finish takes the first record that top-k, top-p and min-p keep. No sort, no block-wide barrier per round, and the cost hardly
// depends on the filters. Sums are integers (exact in any order) and exp/log use correctly rounded float
// operations only, so the numpy sampler draws the same tokens.
// The blocks wait for the merging one: all BLOCKS must be resident at once (BLOCKS <= the SM count; see
// ops.sample).
// budget: sample=96
// defines: BLOCK=512 PER_THREAD=3 BLOCKS=99 MAX_RECORDS=64 MAX_LOGPROBS=20 LP_WORDS=44 WORK_WORDS=15017
// defines: BLOCK=512 BLOCKS=126 LP_WORDS=44 MAX_LOGPROBS=20 MAX_RECORDS=64 PER_THREAD=2 WORK_WORDS=19040
// defines: BLOCK=512 BLOCKS=48 LP_WORDS=44 MAX_LOGPROBS=20 MAX_RECORDS=64 PER_THREAD=2 WORK_WORDS=7418
#include "reduce.cuh"

#define SLICE (BLOCK * PER_THREAD)
#define POOL_PER 6                  // gathered entries per thread in the merges
#define POOL (POOL_PER * BLOCK)
#define PRELOAD 16                  // entries of each block's records gathered at once in the final merge
#ifndef MERGE_GROUPS
#define MERGE_GROUPS BLOCK_WARPS    // warps that merge the blocks' lists in the final merge's first level
#endif
#define CUT 24.0f                   // engine/sampling.py CUT
#define MASS_FLOOR (-28.0f)         // engine/sampling.py MASS_FLOOR
#define MASS_SCALE 0x1p40f          // 2^MASS_BITS

// work: uint64 words, zero before the first launch; each launch leaves the accumulators zero
#define W_ARRIVE 0                  // blocks arrived with their records (grow by BLOCKS per launch)
#define W_DONE 1                    // finished blocks (grow by BLOCKS per launch)
#define W_GREEDY 2                  // packed argmax of the penalized logits
#define W_RAW 3                     // mass of the raw logits (log-probabilities)
#define W_BAD 4                     // nonzero: a logit was not finite
                                    // words 5 to 7: unused
#define W_COUNT 8                   // [MAX_RECORDS + 1] tokens above threshold j (j = 0: all)
#define W_MASS (W_COUNT + MAX_RECORDS + 1) // [MAX_RECORDS + 1] their mass
// the overall records, [MAX_RECORDS] (key, tagged z key) pairs: each z word carries the launch number in its
// upper half (32 bits of it), so that a block polling it knows the word is this launch's without a fence
// or a flag; the slots past the last record hold a tagged 0
#define W_REC (W_MASS + MAX_RECORDS + 1)
#define W_BLOCKS (W_REC + 2 * MAX_RECORDS)
#define B_NREC 0                    // per block: record count, (key, z key) pairs, top raw keys
#define B_REC 1
#define B_TOP (1 + 2 * MAX_RECORDS)
#define BLOCK_WORDS (1 + 2 * MAX_RECORDS + MAX_LOGPROBS)
#define GATHER (BLOCKS * (1 + 2 * PRELOAD)) // words the merging block gathers: count and first PRELOAD records
#define GATHER_PER ((GATHER + BLOCK - 1) / BLOCK)
static_assert(W_BLOCKS + BLOCKS * BLOCK_WORDS == WORK_WORDS, "ops.sample_work_words disagrees with the layout");
static_assert(BLOCKS * MAX_LOGPROBS <= POOL, "the top-n merge gathers every block's list");
static_assert(2 * MAX_RECORDS < BLOCK && PRELOAD <= MAX_RECORDS, "the overall records come in one wave");
static_assert(MAX_RECORDS % 32 == 0, "one warp polls the overall records' z words");
static_assert(MERGE_GROUPS >= 1 && MERGE_GROUPS <= BLOCK_WARPS, "a warp per group of block lists");
static_assert(3 + 2 * MAX_LOGPROBS <= LP_WORDS, "a log-probability slot holds the token, its logprob, n and the top n");

__device__ __forceinline__ float rng_u(unsigned long long seed, unsigned long long step, unsigned long long i) {
    unsigned long long x = seed * 0x9E3779B97F4A7C15ull + step * 0xD1B54A32D192ED03ull + i;
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBull;
    x ^= x >> 31;
    return fminf(__fadd_rn((float)(x >> 40), 0.5f) * 0x1p-24f, 0x1.fffffep-1f);
}

// engine/sampling.py exp_f32 (x in [MASS_FLOOR, 0]) and log_f32 (normal x > 0): the same operations in
// the same order, none fused
__device__ __forceinline__ float exp_f32(float x) {
    const float k = rintf(__fmul_rn(x, 0x1.715476p+0f));
    float r = __fsub_rn(x, __fmul_rn(k, 0x1.63p-1f));
    r = __fsub_rn(r, __fmul_rn(k, -0x1.bd0106p-13f));
    float p = 0x1.a0d2cep-13f;
    p = __fadd_rn(__fmul_rn(p, r), 0x1.6e879cp-10f);
    p = __fadd_rn(__fmul_rn(p, r), 0x1.111210p-7f);
    p = __fadd_rn(__fmul_rn(p, r), 0x1.555382p-5f);
    p = __fadd_rn(__fmul_rn(p, r), 0x1.555554p-3f);
    p = __fadd_rn(__fmul_rn(p, r), 0x1p-1f);
    float y = __fmul_rn(p, __fmul_rn(r, r));
    y = __fadd_rn(y, r);
    y = __fadd_rn(y, 1.0f);
    return __fmul_rn(y, __int_as_float(((int)k + 127) << 23));
}

__device__ __forceinline__ float log_f32(float x) {
    const unsigned b = __float_as_uint(x);
    int e = (int)(b >> 23) - 127;
    float f = __uint_as_float((b & 0x7fffffu) | 0x3f800000u);
    if (f > 0x1.6a09e6p+0f) {
        f = __fmul_rn(f, 0.5f);
        e += 1;
    }
    const float ef = (float)e;
    const float t = __fsub_rn(f, 1.0f);
    const float z = __fmul_rn(t, t);
    float p = 0x1.204376p-4f;
    p = __fadd_rn(__fmul_rn(p, t), -0x1.d7a370p-4f);
    p = __fadd_rn(__fmul_rn(p, t), 0x1.de4a34p-4f);
    p = __fadd_rn(__fmul_rn(p, t), -0x1.fcba9ep-4f);
    p = __fadd_rn(__fmul_rn(p, t), 0x1.23d37ep-3f);
    p = __fadd_rn(__fmul_rn(p, t), -0x1.555ca0p-3f);
    p = __fadd_rn(__fmul_rn(p, t), 0x1.999d58p-3f);
    p = __fadd_rn(__fmul_rn(p, t), -0x1.fffff8p-3f);
    p = __fadd_rn(__fmul_rn(p, t), 0x1.555554p-2f);
    float y = __fmul_rn(t, __fmul_rn(z, p));
    y = __fadd_rn(y, __fmul_rn(ef, -0x1.bd0106p-13f));
    y = __fsub_rn(y, __fmul_rn(0.5f, z));
    const float r = __fadd_rn(t, y);
    return __fadd_rn(r, __fmul_rn(ef, 0x1.63p-1f));
}

// floor(exp_f32(x) * 2^40); 0 below MASS_FLOOR
__device__ __forceinline__ unsigned long long mass_q(float x) {
    return x < MASS_FLOOR ? 0ull : __float2ull_rz(__fmul_rn(exp_f32(x), MASS_SCALE));
}

// the record key of a Gumbel score: the larger score wins, then the lower index
__device__ __forceinline__ unsigned long long score_key(float s, int i) { return argmax_key(s, i); }

__device__ __forceinline__ int key_index(unsigned long long k) { return (int)(0xffffffffu - (unsigned)k); }

// exact sum over the block of values below 2^44, in 22-bit halves (REDUX sums 32-bit lanes)
__device__ __forceinline__ void warp_add_u64(unsigned long long v, unsigned long long* to) {
    const unsigned lo = __reduce_add_sync(0xffffffffu, (unsigned)(v & 0x3fffffull));
    const unsigned hi = __reduce_add_sync(0xffffffffu, (unsigned)(v >> 22));
    if ((threadIdx.x & 31) == 0) atomicAdd(to, ((unsigned long long)hi << 22) + lo);
}

// the warp's largest key (0 if none) on every lane, and in z the z key that came with it
__device__ __forceinline__ unsigned long long warp_best(unsigned long long k, unsigned& z) {
    const unsigned hi = __reduce_max_sync(0xffffffffu, (unsigned)(k >> 32));
    const unsigned lo = __reduce_max_sync(0xffffffffu, (unsigned)(k >> 32) == hi ? (unsigned)k : 0u);
    const unsigned long long best = ((unsigned long long)hi << 32) | lo;
    const unsigned owner = __ballot_sync(0xffffffffu, k == best);
    z = __shfl_sync(0xffffffffu, z, __ffs(owner) - 1);
    return best;
}

// one warp: the records over its lanes' (zk, rk) pairs (zk 0: no entry; rk 0: not a candidate): the
// largest rk, then the largest rk with zk above the last record's, until none is left or MAX_RECORDS
// are found. Lane 0 writes them to out_k / out_z (zk ascending) every `stride` words; returns their count
// on every lane. SORTED: each lane's entries are slices of record lists, zk ascending and so rk descending
// (entries with zk 0 anywhere, and none with rk 0 otherwise), so a lane's best above `low` is its first
// entry above it: one compare and a select per entry, no key compare.
template <int N, bool SORTED = false>
__device__ __forceinline__ int warp_records(const unsigned (&zk)[N], const unsigned long long (&rk)[N],
                                            unsigned long long* out_k, unsigned* out_z, int stride) {
    unsigned low = 0;
    int n = 0;
    for (; n < MAX_RECORDS; ++n) {
        unsigned long long k = 0;
        unsigned z = 0;
        if constexpr (SORTED) {
#pragma unroll
            for (int e = N - 1; e >= 0; --e) {
                if (zk[e] > low) {
                    k = rk[e];
                    z = zk[e];
                }
            }
        } else {
#pragma unroll
            for (int e = 0; e < N; ++e) {
                if (zk[e] > low && rk[e] > k) {
                    k = rk[e];
                    z = zk[e];
                }
            }
        }
        k = warp_best(k, z);
        if (k == 0) break;
        if ((threadIdx.x & 31) == 0) {
            out_k[n * stride] = k;
            out_z[n * stride] = z;
        }
        low = z;
    }
    return n;
}

// one warp: the records over the union of LISTS record lists (list b: len(b) entries entry(b, j, k, z), zk
// ascending and so rk descending). Lane l walks lists l, l + 32, ...: the best entry of a list above `low`
// is its first one above it, so a lane keeps each list's head and moves it only past `low`. Output as
// warp_records, every `stride` words.
template <int LISTS, class Len, class Entry>
__device__ __forceinline__ int merge_records(Len len, Entry entry, unsigned long long* out_k, unsigned* out_z,
                                             int stride) {
    constexpr int T = (LISTS + 31) / 32;
    const int lane = threadIdx.x & 31;
    int at[T], cnt[T];
    unsigned long long hk[T];
    unsigned hz[T];
#pragma unroll
    for (int t = 0; t < T; ++t) {
        at[t] = 0;
        cnt[t] = lane + 32 * t < LISTS ? len(lane + 32 * t) : 0;
        hk[t] = 0;
        hz[t] = 0;
        if (cnt[t] > 0) entry(lane + 32 * t, 0, hk[t], hz[t]);
    }
    unsigned low = 0;
    int n = 0;
    for (; n < MAX_RECORDS; ++n) {
        unsigned long long k = 0;
        unsigned z = 0;
#pragma unroll
        for (int t = 0; t < T; ++t) {
            while (at[t] < cnt[t] && hz[t] <= low) {
                if (++at[t] < cnt[t]) entry(lane + 32 * t, at[t], hk[t], hz[t]);
            }
            if (at[t] < cnt[t] && hk[t] > k) {
                k = hk[t];
                z = hz[t];
            }
        }
        k = warp_best(k, z);
        if (k == 0) break;
        if (lane == 0) {
            out_k[n * stride] = k;
            out_z[n * stride] = z;
        }
        low = z;
    }
    return n;
}

// one warp: the records over LISTS lists (list b: len(b) entries entry(b, j, k, z)) of at most
// Gather<LISTS, N>::CAP entries each, gathered into registers and raced like the warp's own logits
// (warp_records): entry j of list b goes to lane b + WAYS * (j % LANES), slot j / LANES. A round then
// compares registers instead of walking list heads through shared memory.
template <int LISTS, int N>
struct Gather {
    static constexpr int WAYS = LISTS <= 1 ? 1 : LISTS <= 2 ? 2 : LISTS <= 4 ? 4 : LISTS <= 8 ? 8 : LISTS <= 16 ? 16 : 32;
    static constexpr int LANES = 32 / WAYS;
    static constexpr int CAP = LANES * N;
};

template <int LISTS, int N, class Len, class Entry>
__device__ __forceinline__ int gather_records(Len len, Entry entry, unsigned long long* out_k, unsigned* out_z,
                                              int stride) {
    using G = Gather<LISTS, N>;
    static_assert(LISTS <= 32, "a lane per list at least");
    const int lane = threadIdx.x & 31, b = lane % G::WAYS, first = lane / G::WAYS;
    const int cnt = b < LISTS ? len(b) : 0;
    unsigned zk[N];
    unsigned long long rk[N];
#pragma unroll
    for (int i = 0; i < N; ++i) {
        const int j = first + G::LANES * i;
        zk[i] = 0;
        rk[i] = 0;
        if (j < cnt) entry(b, j, rk[i], zk[i]);
    }
    return warp_records<N, true>(zk, rk, out_k, out_z, stride);
}

// warp 0: the records over LISTS per-warp lists (list b: n[b] entries k[j][b], z[j][b]) into out_k / out_z,
// gathered into N registers per lane when every list fits
template <int LISTS, int N>
__device__ __forceinline__ int merge_warp_lists(const int* n, const unsigned long long (*k)[BLOCK_WARPS],
                                                const unsigned (*z)[BLOCK_WARPS], unsigned long long* out_k,
                                                unsigned* out_z) {
    const auto len = [=](int b) { return n[b]; };
    const auto entry = [=](int b, int j, unsigned long long& kk, unsigned& zz) {
        kk = k[j][b];
        zz = z[j][b];
    };
    const int lane = threadIdx.x & 31;
    const int most = __reduce_max_sync(0xffffffffu, lane < LISTS ? (unsigned)n[lane] : 0u);
    if (most <= Gather<LISTS, N>::CAP) return gather_records<LISTS, N>(len, entry, out_k, out_z, 1);
    return merge_records<LISTS>(len, entry, out_k, out_z, 1);
}

// the whole block: the records over LISTS lists (list b: n[b] entries k[j][b], z[j][b], zk ascending), where
// every list fits Gather<LISTS, N>::CAP. List 0's entries cut the z axis into ranges, a warp per range
// (the last range takes what is above the last cut). An entry is a record iff no entry with a z key as
// large has a larger key; those above its range count only through their largest key, so a range's
// records are the records of its entries with a key above that (warp_records over the gathered lists).
// Each warp stages its range's records in stage_k / stage_z, their count in stage_n; returns the number
// of ranges on every thread, after a barrier. Not inlined: the block's own merge and the merging block's
// second level run this one copy of the code, so the second level finds it in the instruction cache.
template <int LISTS, int N>
__device__ __noinline__ int range_race(const int* n, const unsigned long long (*k)[BLOCK_WARPS],
                                       const unsigned (*z)[BLOCK_WARPS], unsigned long long (*stage_k)[MAX_RECORDS],
                                       unsigned (*stage_z)[MAX_RECORDS], int* stage_n) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int ranges = min(n[0], BLOCK_WARPS - 1) + 1;
    if (warp < ranges) {
        const unsigned lo = warp ? z[warp - 1][0] : 0u;
        const bool last = warp == ranges - 1;
        const unsigned hi = last ? 0u : z[warp][0];
        const int b = lane % Gather<LISTS, N>::WAYS, first = lane / Gather<LISTS, N>::WAYS;
        const int cnt = b < LISTS ? n[b] : 0;
        unsigned zk[N];
        unsigned long long rk[N], above = 0;
        // gathered as in gather_records, the largest key above the range taken on the way
#pragma unroll
        for (int i = 0; i < N; ++i) {
            const int j = first + Gather<LISTS, N>::LANES * i;
            zk[i] = 0;
            rk[i] = 0;
            if (j < cnt) {
                zk[i] = z[j][b];
                rk[i] = k[j][b];
            }
            if (!last && zk[i] >= hi) above = max(above, rk[i]);
        }
        {
            unsigned dummy = 0;
            above = warp_best(above, dummy);
        }
#pragma unroll
        for (int i = 0; i < N; ++i)
            if (zk[i] < lo || (!last && zk[i] >= hi) || rk[i] <= above) zk[i] = 0;  // not a candidate here
        const int c = warp_records<N, true>(zk, rk, stage_k[warp], stage_z[warp], 1);
        if (lane == 0) stage_n[warp] = c;
    }
    __syncthreads();
    return ranges;
}

// range_race, then the ranges' records emitted in range order: emit(place, k, z) for the first MAX_RECORDS.
// Returns their count on every thread.
template <int LISTS, int N, class Emit>
__device__ __forceinline__ int range_records(const int* n, const unsigned long long (*k)[BLOCK_WARPS],
                                             const unsigned (*z)[BLOCK_WARPS], unsigned long long (*stage_k)[MAX_RECORDS],
                                             unsigned (*stage_z)[MAX_RECORDS], int* stage_n, Emit emit) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int ranges = range_race<LISTS, N>(n, k, z, stage_k, stage_z, stage_n);
    int at = 0, total = 0;
    for (int r = 0; r < ranges; ++r) {
        const int c = stage_n[r];
        at += r < warp ? c : 0;
        total += c;
    }
    if (warp < ranges) {
        for (int j = lane; j < stage_n[warp] && at + j < MAX_RECORDS; j += 32) emit(at + j, stage_k[warp][j], stage_z[warp][j]);
    }
    return min(total, MAX_RECORDS);
}

// warp g of the merging block: the records over the lists of blocks g, g + MERGE_GROUPS, ... (count pool_n[b],
// the first PRELOAD entries in pool_k / pool_z, with LONGER the rest in the scratch) into column g of
// group_k / group_z, or into out_k / out_z when there is one group
template <bool LONGER>
__device__ __forceinline__ int merge_group(const int* pool_n, const unsigned long long (*pool_k)[BLOCKS],
                                           const unsigned (*pool_z)[BLOCKS], const unsigned long long* work,
                                           unsigned long long* out_k, unsigned* out_z,
                                           unsigned long long (*group_k)[BLOCK_WARPS], unsigned (*group_z)[BLOCK_WARPS]) {
    constexpr int LISTS = (BLOCKS + MERGE_GROUPS - 1) / MERGE_GROUPS;
    const int g = threadIdx.x >> 5;
    const auto len = [=](int l) { return g + MERGE_GROUPS * l < BLOCKS ? pool_n[g + MERGE_GROUPS * l] : 0; };
    if constexpr (!LONGER && LISTS <= 32) {
        constexpr int N = (PRELOAD + Gather<LISTS, 1>::LANES - 1) / Gather<LISTS, 1>::LANES;
        return gather_records<LISTS, N>(
            len,
            [=](int l, int j, unsigned long long& k, unsigned& z) {
                k = pool_k[j][g + MERGE_GROUPS * l];
                z = pool_z[j][g + MERGE_GROUPS * l];
            },
            MERGE_GROUPS > 1 ? &group_k[0][g] : out_k, MERGE_GROUPS > 1 ? &group_z[0][g] : out_z,
            MERGE_GROUPS > 1 ? BLOCK_WARPS : 1);
    }
    return merge_records<LISTS>(
        len,
        [=](int l, int j, unsigned long long& k, unsigned& z) {
            const int b = g + MERGE_GROUPS * l;
            if (!LONGER || j < PRELOAD) {
                k = pool_k[j][b];
                z = pool_z[j][b];
            } else {
                const unsigned long long* from = work + W_BLOCKS + b * BLOCK_WORDS + B_REC + 2 * j;
                k = __ldcg(from);
                z = (unsigned)__ldcg(from + 1);
            }
        },
        MERGE_GROUPS > 1 ? &group_k[0][g] : out_k, MERGE_GROUPS > 1 ? &group_z[0][g] : out_z,
        MERGE_GROUPS > 1 ? BLOCK_WARPS : 1);
}

// record lists in shared memory: (key, z key) pairs, [R][C]
template <int R, int C>
struct KeyLists {
    unsigned long long k[R][C];
    unsigned z[R][C];
};

// double-buffered per-warp bests of a round: one barrier per round
struct Rounds {
    unsigned long long k[2][BLOCK_WARPS];
    unsigned z[2][BLOCK_WARPS];
};

// the block's largest k (0 if none) and the z that came with it, on every thread
__device__ __forceinline__ void block_best(unsigned long long& k, unsigned& z, Rounds& rs, int round) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, buf = round & 1;
    k = warp_best(k, z);
    if (lane == 0) {
        rs.k[buf][warp] = k;
        rs.z[buf][warp] = z;
    }
    __syncthreads();
    k = 0;
    z = 0;
#pragma unroll
    for (int w = 0; w < BLOCK_WARPS; ++w) {
        if (rs.k[buf][w] > k) {
            k = rs.k[buf][w];
            z = rs.z[buf][w];
        }
    }
}

// the n largest keys (distinct; 0 = no entry) in descending order; thread 0 writes them (0 past the end)
template <int N>
__device__ void find_top(const unsigned long long (&rk)[N], int n, unsigned long long* out, Rounds& rs) {
    unsigned long long below = ~0ull;
    for (int j = 0; j < n; ++j) {
        unsigned long long k = 0;
        unsigned z = 0;
#pragma unroll
        for (int e = 0; e < N; ++e)
            if (rk[e] < below && rk[e] > k) k = rk[e];
        block_best(k, z, rs, j);
        if (threadIdx.x == 0) out[j] = k;
        below = k;
    }
    __syncthreads();
}

// *p += v with release and acquire at GPU scope (the block's writes before a __syncthreads go with it,
// and what other blocks released before is seen after it)
__device__ __forceinline__ unsigned long long add_acq_rel(unsigned long long* p, unsigned long long v) {
    unsigned long long old;
    asm volatile("atom.acq_rel.gpu.global.add.u64 %0, [%1], %2;" : "=l"(old) : "l"(p), "l"(v) : "memory");
    return old;
}

__device__ __forceinline__ unsigned long long ld_relaxed(const unsigned long long* p) {
    unsigned long long v;
    asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

// z tagged with the launch number, stored strong (relaxed, GPU scope): other blocks poll it with ld_relaxed
__device__ __forceinline__ void st_tagged(unsigned long long* p, unsigned long long launch, unsigned z) {
    asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" :: "l"(p), "l"((launch << 32) | z) : "memory");
}

#ifdef PROFILE_AT
// dev: clock and globaltimer of block 0's phases (k < 7), the finishing block's end (7) and the merging
// block's (8: arrived, 9: lists gathered, 10: first level merged, 11: records out) to work[PROFILE_AT + 2k]
#define MARK(k, who)                                                                           \
    if ((who) && threadIdx.x == 0) {                                                           \
        unsigned long long t_;                                                                 \
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_));                                 \
        work[PROFILE_AT + 2 * (k)] = clock64();                                                \
        work[PROFILE_AT + 2 * (k) + 1] = t_;                                                   \
    }
#else
#define MARK(k, who)
#endif

// logits: [vocab] f32; amax: argmax_key of the logits from the lm_head GEMV (reset here); tokens:
// [max_ctx] the context (the prompt; the sampler appends); ring: host-mapped [ring_mask + 1] next
// tokens (-1: the logits were not finite); lp_ring: host-mapped [ring_mask + 1][LP_WORDS] token,
// logprob, n, (id, logprob) x n; counts, window: [vocab] generated-token counts and tokens in the
// repeat window; work: [WORK_WORDS] scratch (see above)
extern "C" __global__ void __launch_bounds__(BLOCK, 1)
sample(const float* __restrict__ logits, unsigned long long* amax, DecodeState* st, int* tokens, int* ring,
       int* lp_ring, int* counts, int* window, unsigned long long* work, int vocab, int max_ctx)
{
    __shared__ Rounds rs;
    __shared__ unsigned long long rec_k[MAX_RECORDS], top_keys[MAX_LOGPROBS];
    __shared__ unsigned rec_z[MAX_RECORDS];
    __shared__ unsigned long long above_mass[MAX_RECORDS + 1];
    __shared__ unsigned above_count[MAX_RECORDS + 1];
    // record lists, entry-major so that the lanes walking them read distinct banks; the warps' lists
    // are done with when their partial counts come
    __shared__ union {
        KeyLists<MAX_RECORDS, BLOCK_WARPS> rec;
        struct {
            unsigned long long mass[BLOCK_WARPS][MAX_RECORDS];
            unsigned count[BLOCK_WARPS][MAX_RECORDS];
        } part;
    } per_warp;
    // the merging block's gathered lists; before them, each range's records in range_records
    __shared__ union {
        KeyLists<PRELOAD, BLOCKS> pool;
        KeyLists<BLOCK_WARPS, MAX_RECORDS> stage;
    } lists;
    auto& pool_k = lists.pool.k;
    auto& pool_z = lists.pool.z;
    __shared__ int stage_n[BLOCK_WARPS];
    __shared__ int warp_n[BLOCK_WARPS], pool_n[BLOCKS];
    __shared__ int n_shared, is_last, merging;
    __shared__ unsigned long long launch_no;
    // before the wait, what only the last step's sampler wrote (no kernel of this step), read past L1, where a
    // line could predate that write: the state, for the Gumbel noise; the penalties' window and counts, whose
    // loads miss L2 after the weights streamed through it and so wait beside the lm_head rather than after it;
    // and the token that leaves the repeat window, which the finishing block's end would otherwise wait for
    const int base = blockIdx.x * SLICE;
    float gumbel[PER_THREAD];
    int in_window[PER_THREAD], count[PER_THREAD];
    int leaving = -1;  // the token that leaves the repeat window this step (thread 0 of each block)
    {
        const int pos0 = __ldcg(&st->pos), prompt0 = __ldcg(&st->prompt_len);
        const bool noise = pos0 + 1 >= prompt0 && __ldcg(&st->temperature) > 0.f;
        const unsigned long long seed = __ldcg(&st->seed), step = __ldcg(&st->step);
        const unsigned flags0 = __ldcg(&st->flags);
        if (threadIdx.x == 0 && flags0 & STATE_REPEAT) {
            const int last_n = __ldcg(&st->repeat_last_n), leave = pos0 + 1 - last_n;
            if (last_n > 0 && leave >= 0 && pos0 + 1 < max_ctx) leaving = __ldcg(tokens + leave);
        }
#pragma unroll
        for (int e = 0; e < PER_THREAD; ++e) {
            const int i = base + e * BLOCK + threadIdx.x;
            in_window[e] = flags0 & STATE_REPEAT && i < vocab ? __ldcg(window + i) : 0;
            count[e] = flags0 & STATE_COUNTS && i < vocab ? __ldcg(counts + i) : 0;
            gumbel[e] = noise && i < vocab ? log_f32(-log_f32(rng_u(seed, step, (unsigned long long)i))) : 0.f;
        }
    }
    pdl_enter();
    const DecodeState S = *st;
    const unsigned long long raw_best = *amax;
    const int pos = S.pos, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const bool in_prompt = pos + 1 < S.prompt_len;
    const bool greedy = !(S.temperature > 0.f);
    const bool repeat = S.flags & STATE_REPEAT, counted = S.flags & STATE_COUNTS;
    const bool want_lp = S.logprobs >= 0 && !in_prompt;
    const bool by_count = S.top_k > 0, by_mass = S.top_p < 1.f;
    // min-p alone needs only the records: the merging block finishes right after the merge
    const bool direct = !in_prompt && !greedy && !by_count && !by_mass && !want_lp;
    unsigned long long* mine = work + W_BLOCKS + blockIdx.x * BLOCK_WORDS;
    const float raw_max = val_of((unsigned)(raw_best >> 32));
    int n_rec = 0;
    float m = 0.f;
    MARK(0, blockIdx.x == 0)

    if (!in_prompt) {
        float v[PER_THREAD];
        bool bad = false;
#pragma unroll
        for (int e = 0; e < PER_THREAD; ++e) {
            const int i = base + e * BLOCK + tid;
            float x = NEG_INF;
            if (i < vocab) {
                x = logits[i];
                if (repeat && in_window[e] > 0) x = x > 0.f ? __fdiv_rn(x, S.repeat_penalty) : __fmul_rn(x, S.repeat_penalty);
                if (counted && count[e] > 0)
                    x = __fsub_rn(x, __fadd_rn(S.presence_penalty, __fmul_rn(S.frequency_penalty, (float)count[e])));
                if (!greedy) x = __fdiv_rn(x, S.temperature);
                bad |= !isfinite(x);
            }
            v[e] = x;
        }
        if (__any_sync(0xffffffffu, bad) && lane == 0) atomicOr(work + W_BAD, 1ull);

        if (want_lp) {
            // the raw logits: their mass against the lm_head's max, and this block's MAX_LOGPROBS largest
            unsigned long long q = 0, rk[PER_THREAD];
#pragma unroll
            for (int e = 0; e < PER_THREAD; ++e) {
                const int i = base + e * BLOCK + tid;
                rk[e] = 0;
                if (i < vocab) {
                    const float x = logits[i];
                    q += mass_q(__fsub_rn(x, raw_max));
                    rk[e] = argmax_key(x, i);
                }
            }
            warp_add_u64(q, work + W_RAW);
            find_top<PER_THREAD>(rk, MAX_LOGPROBS, top_keys, rs);
            if (tid < MAX_LOGPROBS) mine[B_TOP + tid] = top_keys[tid];
        }

        if (greedy) {
            if (repeat || counted) {
                unsigned long long k = 0;
                unsigned z = 0;
#pragma unroll
                for (int e = 0; e < PER_THREAD; ++e) {
                    const int i = base + e * BLOCK + tid;
                    if (i < vocab) k = max(k, argmax_key(v[e], i));
                }
                k = warp_best(k, z);
                if (lane == 0) atomicMax(work + W_GREEDY, k);
            }
        } else {
            // the warp's records over its candidates (nothing 24 below the warp's best can win)
            unsigned zk[PER_THREAD];
            unsigned long long rk[PER_THREAD];
            unsigned top = 0;
#pragma unroll
            for (int e = 0; e < PER_THREAD; ++e) {
                const int i = base + e * BLOCK + tid;
                zk[e] = i < vocab ? key_of(v[e]) : 0u;
                top = max(top, zk[e]);
            }
            const unsigned warp_top = __reduce_max_sync(0xffffffffu, top);
            const float m_warp = val_of(warp_top);
#pragma unroll
            for (int e = 0; e < PER_THREAD; ++e) {
                const int i = base + e * BLOCK + tid;
                rk[e] = 0;
                if (zk[e] && v[e] >= m_warp - CUT) {
                    rk[e] = score_key(__fsub_rn(v[e], gumbel[e]), i);
                }
            }
            MARK(1, blockIdx.x == 0)
            const int nw = warp_records<PER_THREAD>(zk, rk, &per_warp.rec.k[0][warp], &per_warp.rec.z[0][warp], BLOCK_WARPS);
            if (lane == 0) warp_n[warp] = nw;
            __syncthreads();
            MARK(2, blockIdx.x == 0)
            // the block's records over the warps' lists, published: a warp per z range when every list fits,
            // else warp 0 alone
            int most = 0;
#pragma unroll
            for (int w = 0; w < BLOCK_WARPS; ++w) most = max(most, warp_n[w]);
            if (most <= Gather<BLOCK_WARPS, 8>::CAP) {
                const int n = range_records<BLOCK_WARPS, 8>(warp_n, per_warp.rec.k, per_warp.rec.z, lists.stage.k,
                                                            lists.stage.z, stage_n,
                                                            [=](int j, unsigned long long k, unsigned z) {
                                                                mine[B_REC + 2 * j] = k;
                                                                mine[B_REC + 2 * j + 1] = z;
                                                            });
                if (tid == 0) mine[B_NREC] = n;
            } else if (warp == 0) {
                const int n = merge_warp_lists<BLOCK_WARPS, 8>(warp_n, per_warp.rec.k, per_warp.rec.z, rec_k, rec_z);
                __syncwarp();
                for (int j = lane; j < n; j += 32) {
                    mine[B_REC + 2 * j] = rec_k[j];
                    mine[B_REC + 2 * j + 1] = rec_z[j];
                }
                if (lane == 0) mine[B_NREC] = n;
            }
            MARK(3, blockIdx.x == 0)

            // the last block to arrive merges every block's records into the overall ones and hands them out
            __syncthreads();
            if (tid == 0) {
                const unsigned long long ticket = add_acq_rel(work + W_ARRIVE, 1ull);
                launch_no = ticket / BLOCKS + 1;
                merging = (ticket + 1) % BLOCKS == 0;
            }
            __syncthreads();
            if (merging) {
                MARK(8, true)
                // each block's count and first PRELOAD records in one wave (list b: words [0, 1 + 2 * PRELOAD))
                unsigned long long got[GATHER_PER];
#pragma unroll
                for (int r = 0; r < GATHER_PER; ++r) {
                    const int j = r * BLOCK + tid;
                    got[r] = j < GATHER ? __ldcg(work + W_BLOCKS + (j / (1 + 2 * PRELOAD)) * BLOCK_WORDS + j % (1 + 2 * PRELOAD)) : 0ull;
                }
                bool longer = false;
#pragma unroll
                for (int r = 0; r < GATHER_PER; ++r) {
                    const int j = r * BLOCK + tid;
                    const int b = j / (1 + 2 * PRELOAD), w = j % (1 + 2 * PRELOAD);
                    if (j >= GATHER) break;
                    if (w == 0) {
                        pool_n[b] = (int)got[r];
                        longer |= got[r] > PRELOAD;
                    } else if (w & 1) {
                        pool_k[w >> 1][b] = got[r];
                    } else {
                        pool_z[(w >> 1) - 1][b] = (unsigned)got[r];
                    }
                }
                longer = __syncthreads_or(longer);
                MARK(9, true)
                // warp g < MERGE_GROUPS merges the lists of blocks g, g + MERGE_GROUPS, ..., then warp 0 merges
                // the groups' lists (with one group, warp 0 merges every block's list at once)
                if (warp < MERGE_GROUPS) {
                    const int n = longer ? merge_group<true>(pool_n, pool_k, pool_z, work, rec_k, rec_z, per_warp.rec.k, per_warp.rec.z)
                                         : merge_group<false>(pool_n, pool_k, pool_z, work, rec_k, rec_z, per_warp.rec.k, per_warp.rec.z);
                    if (lane == 0) warp_n[warp] = n;
                }
                if (MERGE_GROUPS > 1) __syncthreads();
                MARK(10, true)
                int most = 0;
#pragma unroll
                for (int g = 0; g < MERGE_GROUPS; ++g) most = max(most, warp_n[g]);
                if (MERGE_GROUPS > 1 && most <= Gather<MERGE_GROUPS, 12>::CAP) {
                    // a warp per z range; lists that fit 8 entries a lane take the block merge's code (range_race<16, 8>)
                    const auto publish = [&](int j, unsigned long long k, unsigned z) {
                        rec_k[j] = k;
                        rec_z[j] = z;
                        if (!direct) {
                            work[W_REC + 2 * j] = k;
                            st_tagged(work + W_REC + 2 * j + 1, launch_no, z);
                        }
                    };
                    const int n = most <= Gather<MERGE_GROUPS, 8>::CAP
                        ? range_records<MERGE_GROUPS, 8>(warp_n, per_warp.rec.k, per_warp.rec.z, lists.stage.k, lists.stage.z,
                                                         stage_n, publish)
                        : range_records<MERGE_GROUPS, 12>(warp_n, per_warp.rec.k, per_warp.rec.z, lists.stage.k, lists.stage.z,
                                                          stage_n, publish);
                    if (!direct && tid >= n && tid < MAX_RECORDS) st_tagged(work + W_REC + 2 * tid + 1, launch_no, 0u);
                    __syncthreads();
                    if (tid == 0) n_shared = n;
                    MARK(11, !direct)
                } else if (warp == 0) {
                    const int n = MERGE_GROUPS > 1
                        ? merge_warp_lists<MERGE_GROUPS, 12>(warp_n, per_warp.rec.k, per_warp.rec.z, rec_k, rec_z)
                        : warp_n[0];
                    if (lane == 0) n_shared = n;
                    if (!direct) {
                        __syncwarp();
                        for (int j = lane; j < MAX_RECORDS; j += 32) {
                            if (j < n) work[W_REC + 2 * j] = rec_k[j];
                            st_tagged(work + W_REC + 2 * j + 1, launch_no, j < n ? rec_z[j] : 0u);
                        }
                        MARK(11, true)
                    }
                }
                __syncthreads();
            } else {
                if (direct) return;  // min-p alone: the merging block finishes the step
                // warp 0 polls the records' z words until all carry this launch's tag: one trip to L2 after they
                // land, where a flag would need a fence on the merging block's side and a second trip on this
                // one. Only the z keys are needed here; the block that finishes loads the keys.
                if (warp == 0) {
                    constexpr int R = MAX_RECORDS / 32;
                    unsigned long long w[R];
                    bool current;
                    do {
                        current = true;
#pragma unroll
                        for (int r = 0; r < R; ++r) {
                            w[r] = ld_relaxed(work + W_REC + 2 * (lane + 32 * r) + 1);
                            current &= (w[r] >> 32) == (launch_no & 0xffffffffull);
                        }
                    } while (!__all_sync(0xffffffffu, current));
                    int n = 0;
#pragma unroll
                    for (int r = 0; r < R; ++r) {
                        rec_z[lane + 32 * r] = (unsigned)w[r];
                        n += __popc(__ballot_sync(0xffffffffu, (unsigned)w[r] != 0u));
                    }
                    if (lane == 0) n_shared = n;
                }
                __syncthreads();
                MARK(4, blockIdx.x == 0)
            }
            n_rec = n_shared;
            m = n_rec ? val_of(rec_z[n_rec - 1]) : 0.f;  // the last record holds the largest z
            MARK(5, blockIdx.x == 0)

            if (by_count || by_mass) {
                // tokens and masses above each record's z (threshold 0: every token; the last record's: none),
                // per warp, then over the warps
                unsigned long long q[PER_THREAD];
#pragma unroll
                for (int e = 0; e < PER_THREAD; ++e) q[e] = by_mass && zk[e] ? mass_q(__fsub_rn(v[e], m)) : 0ull;
                for (int j = 0; j < n_rec; ++j) {
                    const unsigned t = j ? rec_z[j - 1] : 0u;
                    if (t >= warp_top) {
                        // none of the warp's tokens above this threshold or the later (larger) ones
                        for (int r = j + lane; r < n_rec; r += 32) {
                            per_warp.part.count[warp][r] = 0;
                            per_warp.part.mass[warp][r] = 0;
                        }
                        break;
                    }
                    unsigned c = 0;
                    unsigned long long s = 0;
#pragma unroll
                    for (int e = 0; e < PER_THREAD; ++e) {
                        if (zk[e] > t) {
                            c += 1;
                            s += q[e];
                        }
                    }
                    if (by_count) {
                        c = __reduce_add_sync(0xffffffffu, c);
                        if (lane == 0) per_warp.part.count[warp][j] = c;
                    }
                    if (by_mass) {
                        const unsigned lo = __reduce_add_sync(0xffffffffu, (unsigned)(s & 0x3fffffull));
                        const unsigned hi = __reduce_add_sync(0xffffffffu, (unsigned)(s >> 22));
                        if (lane == 0) per_warp.part.mass[warp][j] = ((unsigned long long)hi << 22) + lo;
                    }
                }
                __syncthreads();
                for (int j = tid; j < n_rec; j += BLOCK) {
                    unsigned long long c = 0, s = 0;
#pragma unroll
                    for (int w = 0; w < BLOCK_WARPS; ++w) {
                        c += per_warp.part.count[w][j];
                        s += per_warp.part.mass[w][j];
                    }
                    if (by_count && c) atomicAdd(work + W_COUNT + j, c);
                    if (by_mass && s) atomicAdd(work + W_MASS + j, s);
                }
            }
            MARK(6, blockIdx.x == 0)
        }
    }

    // the last block to finish (the merging block when nothing is left to add up) writes the step's results
    __syncthreads();
    if (!direct) {
        if (tid == 0) is_last = (add_acq_rel(work + W_DONE, 1ull) + 1) % BLOCKS == 0;
        __syncthreads();
        if (!is_last) return;
    }

    const bool bad = !in_prompt && __ldcg(work + W_BAD) != 0;
    int next;
    if (in_prompt) {
        next = tokens[pos + 1];
    } else if (greedy) {
        next = key_index((repeat || counted) ? __ldcg(work + W_GREEDY) : raw_best);
    } else {
        for (int j = tid; j < n_rec; j += BLOCK) {
            above_mass[j] = by_mass ? __ldcg(work + W_MASS + j) : 0ull;
            above_count[j] = by_count ? (unsigned)__ldcg(work + W_COUNT + j) : 0u;
            if (!direct) rec_k[j] = __ldcg(work + W_REC + 2 * j);  // the merging block's keys (its own: the same)
        }
        __syncthreads();
        next = n_rec ? key_index(rec_k[n_rec - 1]) : 0;  // the last record: every filter keeps the largest z
        const double total = (double)above_mass[0];
        for (int j = 1; j < n_rec; ++j) {
            if (by_count && (int)above_count[j] >= S.top_k) continue;
            if (by_mass && !((double)above_mass[j] < (double)S.top_p * total)) continue;
            if (!(__fsub_rn(val_of(rec_z[j - 1]), m) >= S.min_p_log)) continue;
            next = key_index(rec_k[j - 1]);
            break;
        }
    }
    next = min(max(next, 0), vocab - 1);
    const int slot = pos & S.ring_mask;

    if (want_lp) {
        // log-softmax of the raw logits at the chosen token and at the MAX_LOGPROBS largest over all blocks
        const double lse = (double)raw_max + log((double)__ldcg(work + W_RAW) * 0x1p-40);
        unsigned long long pk[POOL_PER];
#pragma unroll
        for (int e = 0; e < POOL_PER; ++e) {
            const int j = e * BLOCK + tid;
            pk[e] = j < BLOCKS * MAX_LOGPROBS ? __ldcg(work + W_BLOCKS + (j / MAX_LOGPROBS) * BLOCK_WORDS + B_TOP + j % MAX_LOGPROBS) : 0ull;
        }
        const int n = min(S.logprobs, MAX_LOGPROBS);
        find_top<POOL_PER>(pk, n, top_keys, rs);
        int* out = lp_ring + slot * LP_WORDS;
        if (tid < n) {
            const int i = key_index(top_keys[tid]);
            out[3 + 2 * tid] = i;
            out[4 + 2 * tid] = __float_as_int((float)((double)logits[i] - lse));
        }
        if (tid == 0) {
            out[0] = next;
            out[1] = __float_as_int((float)((double)logits[next] - lse));
            out[2] = n;
        }
    }

    // leave the accumulators zero for the next launch
    for (int j = tid; j < n_rec; j += BLOCK) {
        if (by_count) work[W_COUNT + j] = 0;
        if (by_mass) work[W_MASS + j] = 0;
    }
    if (tid == 0) {
        work[W_GREEDY] = 0;
        work[W_RAW] = 0;
        work[W_BAD] = 0;
        *amax = 0ull;
        if (bad) {
            st->flags = S.flags | STATE_NONFINITE;
            next = 0;
        }
        st->token = next;
        st->pos = min(pos + 1, max_ctx);
        if (!in_prompt) st->step = S.step + 1;
        if (pos + 1 < max_ctx) {
            if (!in_prompt) tokens[pos + 1] = next;
            // reductions, not loads and stores: nothing to wait for at the kernel's end
            if (repeat) {
                atomicAdd(window + next, 1);
                if (leaving >= 0) atomicSub(window + leaving, 1);
            }
        }
        if (counted && !in_prompt) atomicAdd(counts + next, 1);
        ring[slot] = bad ? -1 : next;
    }
    MARK(7, true)
}
