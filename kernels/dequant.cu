// Dequantization of repacked ggml rows (kernels/quant_layout.py): a row of the embedding table into
// the decode step's f32 x, and whole matrices into a bf16 scratch for the prefill's GEMMs. Each
// value is ggml's: one exact product and at most one rounding, as gemv_formats.cuh's dequant does.
// budget: embed_quant=64 dequant_rows=64 embed_rows_quant=64
// defines: FORMAT=Q4_K K=4096
// defines: FORMAT=Q6_K K=4096
// defines: FORMAT=Q8_0 K=896
// defines: FORMAT=Q2_K K=256
// defines: FORMAT=Q3_K K=256
// defines: FORMAT=Q5_0 K=96
#include "gemv_formats.cuh"

typedef FORMAT Fmt;
constexpr int W = Fmt::W;

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

// out [rows, K] bf16 = w [rows, K] dequantized and rounded to bf16; a thread per chunk
extern "C" __global__ void dequant_rows(const unsigned char* __restrict__ w, bf16* __restrict__ out, int rows)
{
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * Fmt::CHUNKS) return;
    const int row = (int)(i / Fmt::CHUNKS), k = (int)(i % Fmt::CHUNKS);
    float v[W];
    Fmt::dequant(Fmt::template load<false>(w + (size_t)row * Fmt::ROW_BYTES, k, true), v);
    store_bf16(out + (size_t)row * K + (size_t)k * W, v);
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
