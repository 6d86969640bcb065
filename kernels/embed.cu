// x = embed[token] as fp32, the token read from the decode state (clamped into the vocabulary).
// budget: embed=32
// defines: HIDDEN=4096
// defines: HIDDEN=64
// defines: HIDDEN=3584
// defines: HIDDEN=1536
// defines: HIDDEN=896
// defines: HIDDEN=2048
// defines: HIDDEN=576
#include "common.cuh"

static_assert(HIDDEN % 8 == 0, "hidden size must be a multiple of 8");

// table: [vocab, HIDDEN] bf16; x: [HIDDEN]; grid covers HIDDEN / 8 threads
extern "C" __global__ void embed(const bf16* __restrict__ table, const DecodeState* __restrict__ st,
                                 float* __restrict__ x, int vocab)
{
    pdl_enter();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= HIDDEN / 8) return;
    const int t = min(max(st->token, 0), vocab - 1);
    const uint4 w = reinterpret_cast<const uint4*>(table + (size_t)t * HIDDEN)[i];
    float f[8];
    unpack8(w, f);
    float4* out = reinterpret_cast<float4*>(x) + 2 * i;
    out[0] = make_float4(f[0], f[1], f[2], f[3]);
    out[1] = make_float4(f[4], f[5], f[6], f[7]);
}
