// Two ways to stream an int8 GEMV (y = s_row * W xq, x quantized to int8 per 32 values in each block, dp4a),
// timed as chains of launches under PDL by dev/tma_probe.py:
// - gemv_reg: as kernels/gemv_core.cuh does it. A warp loads its rows 16 bytes a lane into registers, one batch
//   ahead of its dp4a's, the first batch before the PDL wait; one block of 16 warps per SM, whose registers
//   leave no room for the next kernel's block until it exits.
// - gemv_tma: a warp's weights come through a ring of STAGES shared-memory stages filled by bulk copies
//   (cp.async.bulk, completion on an mbarrier per stage): the bytes in flight sit in shared memory, not in
//   registers, so a block needs few registers and two blocks fit an SM: the next kernel's block starts beside
//   this one, fills its whole ring before its PDL wait, and streams while this one ends.
// Both sum each lane's chunks in the same order and reduce a warp the same way: their outputs are equal, bit
// for bit. KX is the row length, NROWS the rows, RPW the rows of a warp's unit (they share each x load).
#include "common.cuh"

#ifndef KX
#define KX 4096
#endif
#ifndef NROWS
#define NROWS 4096
#endif
#ifndef WARPS
#define WARPS 16
#endif
#ifndef RPW
#define RPW 2
#endif
#ifndef BATCH
#define BATCH 4
#endif
#ifndef DPLANE
#define DPLANE 0  // gemv_reg: 0 no block scales; 1 an fp16 d per 32 weights after the row's quants, loaded with
                  // each chunk (kernels/quant_layout.py's D plane); 2 the same d's ordered per batch, one load
#endif
#ifndef STAGES
#define STAGES 0  // 0: gemv_reg, else gemv_tma
#endif

constexpr int CHUNKS = KX / 16;  // 16-byte chunks of a row
constexpr int ITERS = CHUNKS / 32;
constexpr int BATCHES = ITERS / BATCH;
constexpr int UNITS = NROWS / RPW;
constexpr int SEG = BATCH * 512;        // bytes of one row in one batch
constexpr int STAGE = RPW * SEG;        // bytes of one stage
constexpr int ROWB = DPLANE ? KX + KX / 16 : KX;  // bytes of a row: quants, then the d plane
static_assert(ITERS % BATCH == 0 && NROWS % RPW == 0, "whole batches and units");

// the weights' 16-byte loads: ld_early (coherent, kept above the PDL wait) and ld_stream (.nc)
__device__ __forceinline__ uint4 ld_w(const unsigned char* p, bool early) {
    const uint4* q = reinterpret_cast<const uint4*>(p);
    return early ? ld_early(q) : ld_stream(q);
}

// x (fp32, written by the previous kernel) into xq: int8 per 32 values, d = amax / 127, 4 lanes per block
__device__ __forceinline__ void stage_x(const float* __restrict__ x, unsigned char* xq, float* xd) {
    for (int f = threadIdx.x; f < KX / 8; f += blockDim.x) {
        const float4 a = reinterpret_cast<const float4*>(x)[2 * f], b = reinterpret_cast<const float4*>(x)[2 * f + 1];
        float amax = fmaxf(fmaxf(fmaxf(fabsf(a.x), fabsf(a.y)), fmaxf(fabsf(a.z), fabsf(a.w))),
                           fmaxf(fmaxf(fabsf(b.x), fabsf(b.y)), fmaxf(fabsf(b.z), fabsf(b.w))));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
        const float d = amax / 127.0f, id = d > 0.f ? 1.0f / d : 0.f;
        const int q0 = __float2int_rn(a.x * id), q1 = __float2int_rn(a.y * id), q2 = __float2int_rn(a.z * id),
                  q3 = __float2int_rn(a.w * id), q4 = __float2int_rn(b.x * id), q5 = __float2int_rn(b.y * id),
                  q6 = __float2int_rn(b.z * id), q7 = __float2int_rn(b.w * id);
        const unsigned lo = __byte_perm(__byte_perm(q0, q1, 0x0040), __byte_perm(q2, q3, 0x0040), 0x5410);
        const unsigned hi = __byte_perm(__byte_perm(q4, q5, 0x0040), __byte_perm(q6, q7, 0x0040), 0x5410);
        reinterpret_cast<uint2*>(xq)[f] = make_uint2(lo, hi);
        if ((f & 3) == 0) xd[f >> 2] = d;
    }
    __syncthreads();
}

// chunk k of RPW rows against x: 4 dp4a each, times x's block scale and row r's weight scale dw[r]
__device__ __forceinline__ void dot_chunk(const uint4 (&w)[RPW], const float (&dw)[RPW], const unsigned char* xq,
                                          const float* xd, int k, float (&acc)[RPW]) {
    const uint4 q = reinterpret_cast<const uint4*>(xq)[k];
    const float dx = xd[k >> 1];
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
        int s = __dp4a((int)w[r].x, (int)q.x, 0);
        s = __dp4a((int)w[r].y, (int)q.y, s);
        s = __dp4a((int)w[r].z, (int)q.z, s);
        s = __dp4a((int)w[r].w, (int)q.w, s);
        acc[r] = fmaf(dx * dw[r], (float)s, acc[r]);
    }
}

__device__ __forceinline__ void finish(int u, const float* __restrict__ rs, float* __restrict__ y, float (&acc)[RPW],
                                       int lane) {
#pragma unroll
    for (int r = 0; r < RPW; ++r) acc[r] = warp_sum(acc[r]);
    if (lane == 0)
#pragma unroll
        for (int r = 0; r < RPW; ++r) y[u * RPW + r] = acc[r] * rs[u * RPW + r];
}

#if STAGES == 0
__device__ __forceinline__ float h2f(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ unsigned short ld_d(const unsigned char* p, bool early) {
    unsigned short r;
    if (early)
        asm volatile("ld.global.L1::no_allocate.u16 %0, [%1];" : "=h"(r) : "l"(p));
    else
        asm("ld.global.nc.L1::no_allocate.u16 %0, [%1];" : "=h"(r) : "l"(p));
    return r;
}

__device__ __forceinline__ uint2 ld_d4(const unsigned char* p, bool early) {
    uint2 r;
    if (early)
        asm volatile("ld.global.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
    else
        asm("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
    return r;
}

// the d's of batch b of a row for this lane: DPLANE 1 one load per chunk, 2 one load for the batch
__device__ __forceinline__ void load_d(const unsigned char* row, int b, int lane, bool ok, bool early,
                                       unsigned short (&d)[BATCH]) {
    static_assert(DPLANE != 2 || BATCH == 4, "DPLANE 2 loads 4 d's a batch");
    if (DPLANE == 1) {
#pragma unroll
        for (int v = 0; v < BATCH; ++v) d[v] = ok ? ld_d(row + KX + 2 * ((((b * BATCH + v) * 32 + lane)) >> 1), early) : 0;
    } else if (DPLANE == 2) {
        const uint2 q = ok ? ld_d4(row + KX + 2 * ((b * 16 + (lane >> 1)) * BATCH), early) : make_uint2(0, 0);
        d[0] = q.x & 0xffff; d[1] = q.x >> 16; d[2] = q.y & 0xffff; d[3] = q.y >> 16;
    }
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, 1)
    gemv_reg(const unsigned char* __restrict__ w, const float* __restrict__ rs, const float* x, float* y) {
    __shared__ __align__(16) unsigned char xq[KX];
    __shared__ float xd[KX / 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, stride = gridDim.x * WARPS;
    int u = blockIdx.x * WARPS + warp;
    uint4 a[BATCH][RPW];
    unsigned short ad[RPW][BATCH];
#pragma unroll
    for (int v = 0; v < BATCH; ++v)
#pragma unroll
        for (int r = 0; r < RPW; ++r)
            a[v][r] = u < UNITS ? ld_w(w + (size_t)(u * RPW + r) * ROWB + 16 * (v * 32 + lane), true) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int r = 0; r < RPW; ++r) load_d(w + (size_t)(u * RPW + r) * ROWB, 0, lane, u < UNITS, true, ad[r]);
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    stage_x(x, xq, xd);
#pragma unroll 1
    for (; u < UNITS; u += stride) {
        float acc[RPW];
#pragma unroll
        for (int r = 0; r < RPW; ++r) acc[r] = 0.f;
#pragma unroll 1
        for (int b = 0; b < BATCHES; ++b) {
            const bool next_unit = b + 1 == BATCHES;
            const int nu = next_unit ? u + stride : u, nb = next_unit ? 0 : b + 1;
            uint4 na[BATCH][RPW];
            unsigned short nd[RPW][BATCH];
#pragma unroll
            for (int v = 0; v < BATCH; ++v)
#pragma unroll
                for (int r = 0; r < RPW; ++r)
                    na[v][r] = nu < UNITS ? ld_w(w + (size_t)(nu * RPW + r) * ROWB + 16 * ((nb * BATCH + v) * 32 + lane), false)
                                          : make_uint4(0, 0, 0, 0);
#pragma unroll
            for (int r = 0; r < RPW; ++r) load_d(w + (size_t)(nu * RPW + r) * ROWB, nb, lane, nu < UNITS, false, nd[r]);
#pragma unroll
            for (int v = 0; v < BATCH; ++v) {
                float dw[RPW];  // 1 without a d plane: dx * 1 is dx, bit for bit
#pragma unroll
                for (int r = 0; r < RPW; ++r) dw[r] = DPLANE ? h2f(ad[r][v]) : 1.0f;
                dot_chunk(a[v], dw, xq, xd, (b * BATCH + v) * 32 + lane, acc);
            }
#pragma unroll
            for (int v = 0; v < BATCH; ++v)
#pragma unroll
                for (int r = 0; r < RPW; ++r) a[v][r] = na[v][r];
#pragma unroll
            for (int r = 0; r < RPW; ++r)
#pragma unroll
                for (int v = 0; v < BATCH; ++v) ad[r][v] = nd[r][v];
        }
        finish(u, rs, y, acc, lane);
    }
}

#else
__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ bool bar_try_wait(unsigned bar, unsigned parity) {
    unsigned ok;
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(ok) : "r"(bar), "r"(parity) : "memory");
    return ok != 0;
}

// step t of a warp's work: unit u0 + (t / BATCHES) * stride, batch t % BATCHES, into stage t % STAGES
__device__ __forceinline__ void issue(const unsigned char* __restrict__ w, int t, int u0, int stride,
                                      unsigned ring, unsigned bars) {
    const int u = u0 + (t / BATCHES) * stride, b = t % BATCHES, s = t % STAGES;
    if (u >= UNITS) return;
    const unsigned bar = bars + 8 * s;
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(STAGE) : "memory");
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
        const unsigned char* src = w + (size_t)(u * RPW + r) * KX + (size_t)b * SEG;
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     ::"r"(ring + s * STAGE + r * SEG), "l"(src), "r"(SEG), "r"(bar) : "memory");
    }
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, 2)
    gemv_tma(const unsigned char* __restrict__ w, const float* __restrict__ rs, const float* x, float* y) {
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned char* ring_all = smem;                                   // [WARPS][STAGES][RPW][SEG]
    unsigned char* xq = smem + WARPS * STAGES * STAGE;                // [KX]
    float* xd = reinterpret_cast<float*>(xq + KX);                    // [KX / 32]
    unsigned long long* bars_all = reinterpret_cast<unsigned long long*>(xd + KX / 32);  // [WARPS][STAGES]
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, stride = gridDim.x * WARPS;
    const int u0 = blockIdx.x * WARPS + warp;
    const unsigned char* ring_p = ring_all + warp * STAGES * STAGE;
    const unsigned ring = smem_addr(ring_p), bars = smem_addr(bars_all + warp * STAGES);
    if (lane == 0) {
#pragma unroll
        for (int s = 0; s < STAGES; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bars + 8 * s) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#pragma unroll
        for (int t = 0; t < STAGES; ++t) issue(w, t, u0, stride, ring, bars);
    }
    __syncwarp();
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    stage_x(x, xq, xd);
    if (u0 >= UNITS) return;
    float acc[RPW];
#pragma unroll
    for (int r = 0; r < RPW; ++r) acc[r] = 0.f;
#pragma unroll 1
    for (int t = 0;; ++t) {
        const int u = u0 + (t / BATCHES) * stride, b = t % BATCHES, s = t % STAGES;
        if (u >= UNITS) break;
        while (!bar_try_wait(bars + 8 * s, (t / STAGES) & 1)) {
        }
        const unsigned char* st = ring_p + s * STAGE;
#pragma unroll
        for (int v = 0; v < BATCH; ++v) {
            uint4 c[RPW];
#pragma unroll
            for (int r = 0; r < RPW; ++r) c[r] = reinterpret_cast<const uint4*>(st + r * SEG)[v * 32 + lane];
            float dw[RPW];
#pragma unroll
            for (int r = 0; r < RPW; ++r) dw[r] = 1.0f;
            dot_chunk(c, dw, xq, xd, (b * BATCH + v) * 32 + lane, acc);
        }
        __syncwarp();
        if (lane == 0) issue(w, t + STAGES, u0, stride, ring, bars);
        if (b == BATCHES - 1) {
            finish(u, rs, y, acc, lane);
#pragma unroll
            for (int r = 0; r < RPW; ++r) acc[r] = 0.f;
        }
    }
}

#endif

// dynamic shared memory gemv_tma needs
extern "C" __global__ void tma_smem(int* out) { *out = WARPS * STAGES * STAGE + KX + KX / 8 + 8 * WARPS * STAGES; }
