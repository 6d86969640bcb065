#pragma once
// What a GEMV does with the dot products of one unit of ROWS rows, and which rows make a unit.
// One implementation for every weight format: the formats only supply the dot products.
#include "common.cuh"

// epilogues, named for -DEPILOGUE=EPI_ROPE (macros, so that #if can choose the entry point)
#define EPI_STORE 0  // y = Wx + bias (ARGMAX: also fold the rows into the greedy argmax word)
#define EPI_ADD 1    // y += Wx + bias (the residual)
#define EPI_SILU 2   // y = silu(gate + bias) * (up + bias'), gate rows [0, n), up rows [n, 2n)
#define EPI_ROPE 3   // the fused QKV: q and k rotated at the state's position, k and v to the cache
#define EPI_GATE 4   // y = silu(Wx + bias) * y (the gate of a gate/up pair stored apart: up first)

#ifndef EPILOGUE
#define EPILOGUE EPI_STORE
#endif
#ifndef BIAS
#define BIAS 0
#endif
#ifndef ARGMAX
#define ARGMAX 0
#endif
#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#define HALF_DIM (HEAD_DIM / 2)
#ifndef LATE_WAIT
#define LATE_WAIT 0  // gemv_core.cuh
#endif
// XQ_OUT = G > 0 (EPI_SILU): the outputs also go out as the int8 x of the GEMV that reads them next (XQ_IN),
// quantized per 32 exactly as that GEMV's stage_xq would, its granules in the order of a format whose chunks
// hold G of them. A block's pass of units covers whole blocks of 32 rows; after each pass, one warp per
// block of 32 quantizes the rows the pass stashed in shared memory. The next GEMV then copies K + K / 4
// bytes from L2 instead of reading and quantizing 4 K.
#ifndef XQ_OUT
#define XQ_OUT 0
#endif

// what the step writes (x, the position): without the PDL wait before it (LATE_WAIT), read past L1, whose
// lines could predate the previous kernels' writes, from L2, where those writes are
__device__ __forceinline__ float4 ld_x(const float4* p) { return LATE_WAIT ? __ldcg(p) : __ldg(p); }
__device__ __forceinline__ int ld_state_pos(const DecodeState* st) { return LATE_WAIT ? __ldcg(&st->pos) : st->pos; }
#ifndef ROWS
#define ROWS (EPILOGUE == EPI_SILU || EPILOGUE == EPI_ROPE ? 2 : 1)
#endif

static_assert(EPILOGUE >= EPI_STORE && EPILOGUE <= EPI_GATE, "unknown epilogue");
static_assert(!ARGMAX || EPILOGUE == EPI_STORE, "the argmax folds stored rows");
static_assert(ROWS >= 1 && ROWS <= 8, "1 to 8 rows per unit");
static_assert((EPILOGUE != EPI_SILU && EPILOGUE != EPI_ROPE) || ROWS % 2 == 0, "pairs need an even ROWS");
static_assert(EPILOGUE != EPI_ROPE || HALF_DIM % (ROWS / 2) == 0, "a unit's rope pairs stay in one head");

__device__ __forceinline__ float silu(float g) { return g / (1.0f + expf(-g)); }

// EPI_STORE, EPI_ADD, EPI_GATE: a unit is ROWS consecutive rows. EPI_SILU: ROWS / 2 consecutive gate
// rows and the up rows n_out below them. Rows past n_out stream the last row and store nothing.
struct RowEpilogue {
    const float* bias;
    float* y;
    unsigned long long* amax;
    unsigned long long best;  // ARGMAX: the best key of this warp's rows so far
    int n_out;
    size_t row_bytes;
    unsigned char* xq;  // XQ_OUT: [n_out] int8 in the consumer's granule order, then (d, sums) per 32
    int flip;           // XQ_OUT: the half of the stash this pass fills

    static constexpr int PER_UNIT = EPILOGUE == EPI_SILU ? ROWS / 2 : ROWS;
    static constexpr int PASS_ROWS = PER_UNIT * GROUPS;  // rows of one pass of a block's units
    static constexpr bool PASS_SYNC = XQ_OUT > 0;        // every warp of the block reaches pass_end
    static_assert(!XQ_OUT || (EPILOGUE == EPI_SILU && PASS_ROWS % 32 == 0), "XQ_OUT: a pass holds whole blocks");

    // two halves of PASS_ROWS: a warp fills the next pass's half while the quantizing warps read this one's
    static __device__ __forceinline__ float* stash() {
        __shared__ float s[XQ_OUT ? 2 * PASS_ROWS : 1];
        return s;
    }

    __device__ __forceinline__ int units() const { return (n_out + PER_UNIT - 1) / PER_UNIT; }

    __device__ __forceinline__ void rows(int unit, const unsigned char* w, const unsigned char* (&rp)[ROWS]) const {
#pragma unroll
        for (int j = 0; j < PER_UNIT; ++j) {
            const int row = min(unit * PER_UNIT + j, n_out - 1);
            rp[j] = w + (size_t)row * row_bytes;
            if (EPILOGUE == EPI_SILU) rp[j + PER_UNIT] = w + (size_t)(n_out + row) * row_bytes;
        }
    }
    __device__ __forceinline__ void begin() {}
    // every thread of the block, after each pass of units starting at unit `base`
    __device__ __forceinline__ void pass_end(int base) {
        if (!XQ_OUT) return;
        __syncthreads();
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
        const int row0 = base * PER_UNIT;
        for (int b = warp; b < PASS_ROWS / 32 && row0 + 32 * b < n_out; b += WARPS)
            quantize_out(stash()[flip * PASS_ROWS + 32 * b + lane], row0 + 32 * b + lane, lane);
        flip ^= 1;
    }
    // stage_xq's arithmetic for one block of 32 held a value per lane (max and sums do not depend on order)
    __device__ __forceinline__ void quantize_out(float v, int row, int lane) {
        const float amax = warp_max(fabsf(v));
        const float nan = warp_sum(v - v);  // 0 for a finite block, NaN otherwise
        const float d = __fdiv_rn(amax, 127.0f) + nan;
        const float id = d > 0.f ? __frcp_rn(d) : 0.f;
        const int q = __float2int_rn(v * id);
        int sq = q;
#pragma unroll
        for (int o = 8; o > 0; o >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, o);  // this lane's granule
        const int other = __shfl_sync(0xffffffffu, sq, 16);
        const int g = row >> 4, chunks = n_out / (16 * XQ_OUT);
        xq[((g % XQ_OUT) * chunks + g / XQ_OUT) * 16 + (row & 15)] = (unsigned char)q;
        if (lane == 0)
            reinterpret_cast<uint2*>(xq + n_out)[row >> 5] =
                make_uint2(__float_as_uint(d), ((unsigned)sq & 0xffffu) | ((unsigned)other << 16));
    }
    __device__ __forceinline__ void end() {
        if (ARGMAX && best != 0ull && best > *(volatile unsigned long long*)amax) atomicMax(amax, best);
    }
    __device__ __forceinline__ void operator()(int unit, const float (&acc)[ROWS]) {
#pragma unroll
        for (int j = 0; j < PER_UNIT; ++j) {
            const int row = unit * PER_UNIT + j;
            if (row >= n_out) break;
            const float v = BIAS ? acc[j] + bias[row] : acc[j];
            if (EPILOGUE == EPI_STORE) y[row] = v;
            if (EPILOGUE == EPI_ADD) y[row] += v;
            if (EPILOGUE == EPI_GATE) y[row] = silu(v) * y[row];
            if (EPILOGUE == EPI_SILU) {
                const float up = BIAS ? acc[j + PER_UNIT] + bias[n_out + row] : acc[j + PER_UNIT];
                const float out = silu(v) * up;
                y[row] = out;
                if (XQ_OUT) stash()[flip * PASS_ROWS + row % PASS_ROWS] = out;
            }
            if (ARGMAX) best = max(best, argmax_key(v, row));
        }
    }
};

// EPI_ROPE: a unit is ROWS / 2 consecutive rope pairs of one head: rows i and i + HALF_DIM of the
// head. The launch covers heads [head0, head0 + its pairs / HALF_DIM) of q | k | v; its weight rows
// start at the first of them, y and bias are indexed by the absolute row.
struct RopeEpilogue {
    const float* bias;
    float* y;
    const DecodeState* st;
    const float *cos_t, *sin_t;
    bf16 *k_cache, *v_cache;
    int n_pairs, nh, nkv, max_ctx, head0, pos;
    size_t row_bytes;

    static constexpr int PER_UNIT = ROWS / 2;
    static constexpr bool PASS_SYNC = false;

    __device__ __forceinline__ int units() const { return n_pairs / PER_UNIT; }

    __device__ __forceinline__ void rows(int unit, const unsigned char* w, const unsigned char* (&rp)[ROWS]) const {
#pragma unroll
        for (int j = 0; j < PER_UNIT; ++j) {
            const int p = unit * PER_UNIT + j;
            const size_t row = (size_t)(p / HALF_DIM) * HEAD_DIM + p % HALF_DIM;
            rp[j] = w + row * row_bytes;
            rp[j + PER_UNIT] = w + (row + HALF_DIM) * row_bytes;
        }
    }
    __device__ __forceinline__ void begin() { pos = min(max(ld_state_pos(st), 0), max_ctx - 1); }
    __device__ __forceinline__ void pass_end(int) {}
    __device__ __forceinline__ void end() {}
    __device__ __forceinline__ void operator()(int unit, const float (&acc)[ROWS]) {
#pragma unroll
        for (int j = 0; j < PER_UNIT; ++j) {
            const int p = unit * PER_UNIT + j;
            const int head = head0 + p / HALF_DIM, i = p % HALF_DIM;
            const int r0 = head * HEAD_DIM + i;
            float a = BIAS ? acc[j] + bias[r0] : acc[j];
            float b = BIAS ? acc[j + PER_UNIT] + bias[r0 + HALF_DIM] : acc[j + PER_UNIT];
            if (head < nh + nkv) rotate_pair(a, b, cos_t[(size_t)pos * HALF_DIM + i], sin_t[(size_t)pos * HALF_DIM + i]);
            y[r0] = a;
            y[r0 + HALF_DIM] = b;
            if (head >= nh) {
                const bool is_v = head >= nh + nkv;
                const int kvh = head - nh - (is_v ? nkv : 0);
                bf16* dst = (is_v ? v_cache : k_cache) + ((size_t)kvh * max_ctx + pos) * HEAD_DIM + i;
                dst[0] = f2bf(a);
                dst[HALF_DIM] = f2bf(b);
            }
        }
    }
};
