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

// what the step writes (x, the position): without the PDL wait before it (LATE_WAIT), read past L1, whose
// lines could predate the previous kernels' writes, from L2, where those writes are. Never a non-coherent
// (.nc) load: ptxas takes .nc data for constant through the kernel's life and schedules such loads across the
// PDL wait, above it where the next kernel's launch no longer sits between them (PDL_TRIGGER_FIRST)
__device__ __forceinline__ float4 ld_x(const float4* p) { return LATE_WAIT ? __ldcg(p) : __ldca(p); }
__device__ __forceinline__ int ld_state_pos(const DecodeState* st) { return LATE_WAIT ? __ldcg(&st->pos) : __ldca(&st->pos); }
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

    static constexpr int PER_UNIT = EPILOGUE == EPI_SILU ? ROWS / 2 : ROWS;

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
                y[row] = silu(v) * up;
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
