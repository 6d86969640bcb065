// Dequantization of repacked ggml rows (kernels/quant_layout.py): a row of the embedding table into
// the decode step's f32 x, and rows of a matrix into a bf16 scratch for the prefill's GEMMs. Each
// value is ggml's: one exact product and at most one rounding, as gemv_formats.cuh's dequant does.
// budget: embed_quant=64 dequant_rows=64 embed_rows_quant=64
// defines: FORMAT=Q4_K K=4096
// defines: FORMAT=Q4_K K=4096 ITEMS=4 STAGE=0
// defines: FORMAT=Q6_K K=4096 ITEMS=4 STAGE=1
// defines: FORMAT=Q6_K K=4096
// defines: FORMAT=Q8_0 K=896
// defines: FORMAT=Q8_0 K=4096 ITEMS=8 STAGE=1
// defines: FORMAT=Q4_0 K=4096 ITEMS=4 STAGE=0
// defines: FORMAT=Q2_K K=256
// defines: FORMAT=Q2_K K=4096 STAGE=0
// defines: FORMAT=Q5_K K=4096 ITEMS=4 STAGE=0
// defines: FORMAT=Q3_K K=256 ITEMS=2 STAGE=1
// defines: FORMAT=Q5_0 K=96
// defines: K=576 FORMAT=Q8_0
#include "gemv_formats.cuh"

// dequant_rows: chunks per thread (their loads all issued before the first store), and whether a
// warp's bf16 goes out through shared memory as unit-stride 16-byte stores
#ifndef ITEMS
#define ITEMS 1
#endif
#ifndef STAGE
#define STAGE 1
#endif
#ifndef THREADS
#define THREADS 128
#endif

typedef FORMAT Fmt;
constexpr int W = Fmt::W;
constexpr int PIECES = W / 8;  // 16-byte pieces of bf16 per chunk

template <int N>
__device__ __forceinline__ void store_f32(float* out, const float (&v)[N]) {
    float4* o = reinterpret_cast<float4*>(out);
#pragma unroll
    for (int i = 0; i < N / 4; ++i) o[i] = make_float4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
}

template <int N>
__device__ __forceinline__ void store_bf16(bf16* out, const float (&v)[N]) {
    uint4* o = reinterpret_cast<uint4*>(out);
#pragma unroll
    for (int i = 0; i < N / 8; ++i)
        o[i] = make_uint4(pack_bf2(v[8 * i], v[8 * i + 1]), pack_bf2(v[8 * i + 2], v[8 * i + 3]),
                          pack_bf2(v[8 * i + 4], v[8 * i + 5]), pack_bf2(v[8 * i + 6], v[8 * i + 7]));
}

// x [K] f32 = row st->token of table [vocab, K] (clamped into the vocabulary); a thread per chunk
extern "C" __global__ void embed_quant(const unsigned char* __restrict__ table, const DecodeState* __restrict__ st,
                                       float* __restrict__ x, int vocab)
{
    pdl_enter();
    const int k = blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= Fmt::CHUNKS) return;
    const int t = min(max(st->token, 0), vocab - 1);
    float v[W];
    Fmt::dequant(Fmt::template load<false>(table + (size_t)t * Fmt::ROW_BYTES, k, true), v);
    store_f32(x + (size_t)k * W, v);
}

// two floats -> two bf16, rounded to nearest even by the hardware's paired convert: f2bf's bits for
// every finite value, and the values here are finite (half_f reads every fp16 scale as a finite float)
__device__ __forceinline__ unsigned cvt_bf2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ uint4 bf16_piece(const float* v) {
    return make_uint4(cvt_bf2(v[0], v[1]), cvt_bf2(v[2], v[3]), cvt_bf2(v[4], v[5]), cvt_bf2(v[6], v[7]));
}

// out [rows, K] bf16 = w [rows, K] dequantized and rounded to bf16. Chunk i (row i / CHUNKS) lands at
// out + i * W, so a warp's 32 consecutive chunks fill one contiguous run of out. Thread t of block b
// takes chunks (b * ITEMS + j) * THREADS + t for j < ITEMS; launch with THREADS threads (64 registers
// each: a full SM).
extern "C" __global__ void __launch_bounds__(THREADS, 65536 / 64 / THREADS) dequant_rows(const unsigned char* __restrict__ w,
                                                                   bf16* __restrict__ out, int rows)
{
    const int n = rows * Fmt::CHUNKS;  // the host keeps it below 2^31
    const int first = blockIdx.x * ITEMS * THREADS + threadIdx.x;
    typename Fmt::Chunk c[ITEMS];
#pragma unroll
    for (int j = 0; j < ITEMS; ++j) {
        const int i = first + j * THREADS;
        const bool ok = i < n;
        const int row = ok ? i / Fmt::CHUNKS : 0;
        c[j] = Fmt::template load<false>(w + (size_t)row * Fmt::ROW_BYTES, ok ? i - row * Fmt::CHUNKS : 0, ok);
    }
#if STAGE
    // a warp's chunks through shared memory: lane l's pieces at slots l * PIECES + (p ^ swizzle), then
    // each lane stores pieces lane, lane + 32, ... of the warp's contiguous run
    __shared__ uint4 stage[THREADS * PIECES];
    const int lane = threadIdx.x & 31;
    uint4* mine = stage + (threadIdx.x & ~31) * PIECES;
    const int swz = lane % PIECES;
#pragma unroll
    for (int j = 0; j < ITEMS; ++j) {
        const int i0 = first - lane + j * THREADS;  // the warp's first chunk
        float v[W];
        Fmt::dequant(c[j], v);
#pragma unroll
        for (int p = 0; p < PIECES; ++p) mine[lane * PIECES + (p ^ swz)] = bf16_piece(v + 8 * p);
        __syncwarp();
        const int valid = min(n - i0, 32) * PIECES;
        uint4* dst = reinterpret_cast<uint4*>(out + (size_t)i0 * W);
#pragma unroll
        for (int m = 0; m < PIECES; ++m) {
            const int q = lane + 32 * m, owner = q / PIECES;
            if (q < valid) dst[q] = mine[owner * PIECES + ((q % PIECES) ^ (owner % PIECES))];
        }
        __syncwarp();
    }
#else
#pragma unroll
    for (int j = 0; j < ITEMS; ++j) {
        const int i = first + j * THREADS;
        if (i >= n) break;
        float v[W];
        Fmt::dequant(c[j], v);
        uint4* dst = reinterpret_cast<uint4*>(out + (size_t)i * W);
#pragma unroll
        for (int p = 0; p < PIECES; ++p) dst[p] = bf16_piece(v + 8 * p);
    }
#endif
}

// the prefill's x [t, K] f32 = row prompt[pos0 + t] of table (clamped) for t < T; grid (chunk rows,
// chunks / blockDim)
extern "C" __global__ void embed_rows_quant(int pos0, int T, const unsigned char* __restrict__ table,
                                            const int* __restrict__ prompt, float* __restrict__ x, int vocab)
{
    const int t = blockIdx.x, k = blockIdx.y * blockDim.x + threadIdx.x;
    if (t >= T || k >= Fmt::CHUNKS) return;
    const int tok = min(max(prompt[pos0 + t], 0), vocab - 1);
    float v[W];
    Fmt::dequant(Fmt::template load<false>(table + (size_t)tok * Fmt::ROW_BYTES, k, true), v);
    store_f32(x + (size_t)t * K + (size_t)k * W, v);
}
