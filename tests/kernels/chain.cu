// Small kernels for the launch and graph tests: no headers, float32 only.
// budget: axpb=32 scale=32 block_sum=48
// defines: BLOCK=256

#ifndef BLOCK
#define BLOCK 256
#endif

// Wait for the previous kernel's writes when launched as a programmatic dependent; a no-op otherwise.
__device__ __forceinline__ void wait_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// y = a * x + b
extern "C" __global__ void axpb(float* __restrict__ y, const float* __restrict__ x, float a, float b, int n) {
    wait_prior_grid();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        y[i] = fmaf(a, x[i], b);
}

// y = x * s[0]: the factor is device data, read at run time
extern "C" __global__ void scale(float* __restrict__ y, const float* __restrict__ x, const float* __restrict__ s, int n) {
    wait_prior_grid();
    const float f = s[0];
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        y[i] = x[i] * f;
}

// out[0] = sum(x) in a fixed order: one block of BLOCK threads
extern "C" __global__ void __launch_bounds__(BLOCK) block_sum(float* __restrict__ out, const float* __restrict__ x, int n) {
    __shared__ float warp_sums[BLOCK / 32];
    wait_prior_grid();
    float acc = 0.f;
    for (int i = threadIdx.x; i < n; i += BLOCK)
        acc += x[i];
    for (int o = 16; o > 0; o >>= 1)
        acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if ((threadIdx.x & 31) == 0)
        warp_sums[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x < 32) {
        acc = threadIdx.x < BLOCK / 32 ? warp_sums[threadIdx.x] : 0.f;
        for (int o = 16; o > 0; o >>= 1)
            acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (threadIdx.x == 0)
            out[0] = acc;
    }
}
