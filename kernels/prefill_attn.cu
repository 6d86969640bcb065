// Causal flash attention of a prefill chunk against the KV cache: bf16 tensor cores (mma.sync
// m16n8k16, fp32 accumulators), online softmax in the base-2 domain, no score matrix in memory.
// Block (tile, kv head) owns BM = 16 * WARPS query rows packed as TOK = BM / G tokens x the G query
// heads of one kv head, so every K/V tile in shared memory serves the whole group; warp w owns rows
// 16w..16w+15, row r being token t0 + r / G, head kvh * G + r % G. Token t sits at position pos0 + t
// and sees cache rows [0, pos0 + t]. K/V tiles of BN rows stream through two cp.async stages; rows
// past the block's last position are zero-filled (a poisoned cache never reaches the sums).
// budget: prefill_attn=255
// defines: HD=128 G=4 WARPS=4
// defines: HD=128 G=4 WARPS=8
// defines: HD=64 G=7 WARPS=4
// defines: HD=32 G=3 WARPS=4
// defines: HD=16 G=2 WARPS=8
#include "common.cuh"

#ifndef WARPS
#define WARPS 4
#endif
#define BM (16 * WARPS)
#define BN 64
#define TOK (BM / G)
#define LDS (HD + 8)
#define KS (HD / 16)
#define DT (HD / 8)
#define NT (BN / 8)
#define STAGE_BYTES (2 * BN * LDS * 2)

static_assert(HD % 16 == 0 && HD <= 128, "head_dim must be a multiple of 16, at most 128");
static_assert(G >= 1 && G <= BM, "group size must be at most 16 * WARPS");

__device__ __forceinline__ void mma_bf16(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ldsm4(unsigned addr, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr) : "memory");
}

__device__ __forceinline__ void ldsm4_t(unsigned addr, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr) : "memory");
}

// 16 bytes global -> shared; src_bytes = 0 writes zeros and reads nothing
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory"); }

__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// lo in the low half
__device__ __forceinline__ unsigned cvt_bf2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// q: [C, nh, HD] bf16, pre-scaled by hd^-0.5 * log2(e); k_cache, v_cache: this layer's
// [nkv, max_ctx, HD] bf16; out: [C, nh * HD] bf16. Grid (ceil(C / TOK), nkv), dynamic smem 2 * STAGE_BYTES
extern "C" __global__ void __launch_bounds__(WARPS * 32, 8 / WARPS)
prefill_attn(int pos0, int T, const bf16* __restrict__ q, const bf16* __restrict__ k_cache,
             const bf16* __restrict__ v_cache, bf16* __restrict__ out, int max_ctx)
{
    extern __shared__ __align__(16) unsigned char smem[];
    const int t0 = (gridDim.x - 1 - blockIdx.x) * TOK;  // the longest tiles start first
    if (t0 >= T) return;
    const int kvh = blockIdx.y, nh = gridDim.y * G;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gid = lane >> 2, tig = lane & 3;
    const int t_last = min(t0 + TOK, T) - 1;
    const int kv_len = pos0 + t_last + 1;

    // this lane's two rows; padding rows borrow the last token so that their math stays finite
    const int ra = warp * 16 + gid, rb = ra + 8;
    const int ta = min(t0 + ra / G, t_last), tb = min(t0 + rb / G, t_last);
    const int pa = pos0 + ta, pb = pos0 + tb;
    const bool va = ra < TOK * G && t0 + ra / G <= t_last;
    const bool vb = rb < TOK * G && t0 + rb / G <= t_last;
    const int wlo = pos0 + min(t0 + warp * 16 / G, t_last);
    const int whi = pos0 + min(t0 + (warp * 16 + 15) / G, t_last);
    const size_t oa = ((size_t)ta * nh + kvh * G + ra % G) * HD + tig * 2;
    const size_t ob = ((size_t)tb * nh + kvh * G + rb % G) * HD + tig * 2;

    unsigned qf[KS][4];
#pragma unroll
    for (int k = 0; k < KS; ++k) {
        qf[k][0] = *reinterpret_cast<const unsigned*>(q + oa + k * 16);
        qf[k][1] = *reinterpret_cast<const unsigned*>(q + ob + k * 16);
        qf[k][2] = *reinterpret_cast<const unsigned*>(q + oa + k * 16 + 8);
        qf[k][3] = *reinterpret_cast<const unsigned*>(q + ob + k * 16 + 8);
    }
    float o[DT][4];
#pragma unroll
    for (int d = 0; d < DT; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
    float ma = NEG_INF, mb = NEG_INF, la = 0.f, lb = 0.f;

    const bf16* kg = k_cache + (size_t)kvh * max_ctx * HD;
    const bf16* vg = v_cache + (size_t)kvh * max_ctx * HD;
    const unsigned sbase = (unsigned)__cvta_generic_to_shared(smem);
    // stage s: K [BN][LDS] then V [BN][LDS]; rows padded by 16 bytes so ldmatrix is conflict-free
    auto load = [&](int tile, int stage) {
        const int n0 = tile * BN;
        for (int c = threadIdx.x; c < BN * HD / 8; c += WARPS * 32) {
            const int row = c / (HD / 8), col = c % (HD / 8) * 8;
            const bool ok = n0 + row < kv_len;
            const size_t off = ok ? (size_t)(n0 + row) * HD + col : 0;
            const unsigned dst = sbase + stage * STAGE_BYTES + (row * LDS + col) * 2;
            cp_async16(dst, kg + off, ok ? 16 : 0);
            cp_async16(dst + BN * LDS * 2, vg + off, ok ? 16 : 0);
        }
        cp_commit();
    };

    const int ntiles = (kv_len + BN - 1) / BN;
    load(0, 0);
    for (int it = 0; it < ntiles; ++it) {
        if (it + 1 < ntiles) {
            load(it + 1, (it + 1) & 1);
            cp_wait<1>();
        } else {
            cp_wait<0>();
        }
        __syncthreads();
        const int n0 = it * BN;
        if (n0 <= whi) {
            const unsigned sk = sbase + (it & 1) * STAGE_BYTES, sv = sk + BN * LDS * 2;
            float s[NT][4];
#pragma unroll
            for (int n = 0; n < NT; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
            for (int k = 0; k < KS; ++k) {
#pragma unroll
                for (int np = 0; np < NT / 2; ++np) {
                    const int key = np * 16 + (lane >> 4) * 8 + (lane & 7);
                    const int dim = k * 16 + ((lane >> 3) & 1) * 8;
                    unsigned b0, b1, b2, b3;
                    ldsm4(sk + (key * LDS + dim) * 2, b0, b1, b2, b3);
                    mma_bf16(s[2 * np], qf[k], b0, b1);
                    mma_bf16(s[2 * np + 1], qf[k], b2, b3);
                }
            }
            if (n0 + BN - 1 > wlo) {
#pragma unroll
                for (int n = 0; n < NT; ++n) {
                    const int key = n0 + n * 8 + tig * 2;
                    if (key > pa) s[n][0] = NEG_INF;
                    if (key + 1 > pa) s[n][1] = NEG_INF;
                    if (key > pb) s[n][2] = NEG_INF;
                    if (key + 1 > pb) s[n][3] = NEG_INF;
                }
            }
            float xa = ma, xb = mb;
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                xa = fmaxf(xa, fmaxf(s[n][0], s[n][1]));
                xb = fmaxf(xb, fmaxf(s[n][2], s[n][3]));
            }
            xa = fmaxf(xa, __shfl_xor_sync(0xffffffffu, xa, 1));
            xa = fmaxf(xa, __shfl_xor_sync(0xffffffffu, xa, 2));
            xb = fmaxf(xb, __shfl_xor_sync(0xffffffffu, xb, 1));
            xb = fmaxf(xb, __shfl_xor_sync(0xffffffffu, xb, 2));
            // key 0 is in every row's first tile, so xa, xb are finite from here on
            const float ca = ex2(ma - xa), cb = ex2(mb - xb);
            ma = xa;
            mb = xb;
            la *= ca;
            lb *= cb;
#pragma unroll
            for (int d = 0; d < DT; ++d) {
                o[d][0] *= ca;
                o[d][1] *= ca;
                o[d][2] *= cb;
                o[d][3] *= cb;
            }
            unsigned pf[BN / 16][4];
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                const float p0 = ex2(s[n][0] - ma), p1 = ex2(s[n][1] - ma);
                const float p2 = ex2(s[n][2] - mb), p3 = ex2(s[n][3] - mb);
                la += p0 + p1;
                lb += p2 + p3;
                pf[n / 2][(n & 1) * 2] = cvt_bf2(p0, p1);
                pf[n / 2][(n & 1) * 2 + 1] = cvt_bf2(p2, p3);
            }
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) {
#pragma unroll
                for (int dp = 0; dp < DT / 2; ++dp) {
                    const int key = kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7);
                    const int dim = dp * 16 + (lane >> 4) * 8;
                    unsigned b0, b1, b2, b3;
                    ldsm4_t(sv + (key * LDS + dim) * 2, b0, b1, b2, b3);
                    mma_bf16(o[2 * dp], pf[kk], b0, b1);
                    mma_bf16(o[2 * dp + 1], pf[kk], b2, b3);
                }
            }
        }
        __syncthreads();
    }

    la += __shfl_xor_sync(0xffffffffu, la, 1);
    la += __shfl_xor_sync(0xffffffffu, la, 2);
    lb += __shfl_xor_sync(0xffffffffu, lb, 1);
    lb += __shfl_xor_sync(0xffffffffu, lb, 2);
    const float ia = 1.0f / la, ib = 1.0f / lb;
#pragma unroll
    for (int d = 0; d < DT; ++d) {
        if (va) *reinterpret_cast<unsigned*>(out + oa + d * 8) = cvt_bf2(o[d][0] * ia, o[d][1] * ia);
        if (vb) *reinterpret_cast<unsigned*>(out + ob + d * 8) = cvt_bf2(o[d][2] * ib, o[d][3] * ib);
    }
}
