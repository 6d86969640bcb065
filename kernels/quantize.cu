// bf16 matrices to ggml Q8_0 / Q4_0 blocks, as ggml-quants.c's reference quantizer does it (and the
// gguf package, bit for bit): fp32 math, one rounding per operation (no contraction into FMAs),
// IEEE division, the scale rounded to fp16 last. A thread per block of 32 values.
// budget: quantize_q8_0=64 quantize_q4_0=64
// defines: NONE=0
#include "common.cuh"

__device__ __forceinline__ unsigned short half_bits(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ void load32(const bf16* __restrict__ src, long long b, float (&x)[32]) {
    const uint4* p = reinterpret_cast<const uint4*>(src + 32 * b);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float f[8];
        unpack8(p[i], f);
#pragma unroll
        for (int j = 0; j < 8; ++j) x[8 * i + j] = f[j];
    }
}

// src: [n_blocks * 32] bf16; out: [n_blocks, 34]: fp16 d = max|x| / 127, then int8 round(x / d)
extern "C" __global__ void quantize_q8_0(const bf16* __restrict__ src, unsigned char* __restrict__ out,
                                         long long n_blocks)
{
    const long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= n_blocks) return;
    float x[32];
    load32(src, b, x);
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < 32; ++i) amax = fmaxf(amax, fabsf(x[i]));
    const float d = __fdiv_rn(amax, 127.0f);
    const float id = d == 0.f ? 0.f : __fdiv_rn(1.0f, d);
    unsigned short* o = reinterpret_cast<unsigned short*>(out + 34 * b);
    o[0] = half_bits(d);
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        const int lo = (int)roundf(__fmul_rn(x[2 * i], id)), hi = (int)roundf(__fmul_rn(x[2 * i + 1], id));
        o[1 + i] = (unsigned short)((lo & 0xff) | ((hi & 0xff) << 8));
    }
}

// src: [n_blocks * 32] bf16; out: [n_blocks, 18]: fp16 d = (the value of largest magnitude, the first
// on ties) / -8, then 4-bit min(15, trunc(x / d + 8.5)), value j in the low nibble of byte j and
// value j + 16 in its high nibble
extern "C" __global__ void quantize_q4_0(const bf16* __restrict__ src, unsigned char* __restrict__ out,
                                         long long n_blocks)
{
    const long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= n_blocks) return;
    float x[32];
    load32(src, b, x);
    float amax = fabsf(x[0]), vmax = x[0];
#pragma unroll
    for (int i = 1; i < 32; ++i)
        if (fabsf(x[i]) > amax) {
            amax = fabsf(x[i]);
            vmax = x[i];
        }
    const float d = __fdiv_rn(vmax, -8.0f);
    const float id = d == 0.f ? 0.f : __fdiv_rn(1.0f, d);
    unsigned short* o = reinterpret_cast<unsigned short*>(out + 18 * b);
    o[0] = half_bits(d);
    unsigned q[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) q[i] = min(15u, (unsigned)truncf(__fadd_rn(__fmul_rn(x[i], id), 8.5f)));
#pragma unroll
    for (int i = 0; i < 8; ++i)
        o[1 + i] = (unsigned short)((q[2 * i] | (q[2 * i + 16] << 4)) | ((q[2 * i + 1] | (q[2 * i + 17] << 4)) << 8));
}
