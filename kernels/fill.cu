// Random tensors made on the device (benchmarks of full-size shapes need no host copy):
// value = offset + scale * (2u - 1), u uniform in (0, 1) from a splitmix64 hash of (seed, i).
// budget: fill_bf16=32 fill_f32=32
// defines: NONE=0
#include "common.cuh"

__device__ __forceinline__ float uniform_pm1(unsigned long long seed, unsigned long long i) {
    unsigned long long x = seed * 0x9E3779B97F4A7C15ull + i;
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBull;
    x ^= x >> 31;
    return ((float)(x >> 40) + 0.5f) * 0x1p-23f - 1.0f;
}

extern "C" __global__ void fill_bf16(bf16* __restrict__ out, long long n, unsigned long long seed, float scale,
                                     float offset)
{
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = f2bf(offset + scale * uniform_pm1(seed, i));
}

extern "C" __global__ void fill_f32(float* __restrict__ out, long long n, unsigned long long seed, float scale,
                                    float offset)
{
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = offset + scale * uniform_pm1(seed, i);
}
