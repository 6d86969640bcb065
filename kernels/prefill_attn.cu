// Causal flash attention of a prefill chunk against the KV cache: bf16 tensor cores (mma.sync
// m16n8k16, fp32 accumulators), online softmax in the base-2 domain, no score matrix in memory.
// Block (tile, kv head) owns BLOCK_ROWS = 16 * WARPS query rows packed as BLOCK_TOKENS =
// BLOCK_ROWS / GROUP tokens x the GROUP query heads of one kv head, so every K/V tile in shared
// memory serves the whole group; warp w owns rows 16w..16w+15, row r being token t0 + r / GROUP, head
// kvh * GROUP + r % GROUP. Token t sits at position pos0 + t and sees cache rows [0, pos0 + t]. K/V
// tiles of KV_TILE rows stream through two cp.async stages; rows past the block's last position are
// zero-filled (a poisoned cache never reaches the sums).
// Defines: HEAD_DIM, GROUP (query heads per kv head), WARPS, KV_TILE (the host sizes shared memory by it).
// budget: prefill_attn=255
// defines: HEAD_DIM=128 GROUP=4 WARPS=4 KV_TILE=64
// defines: HEAD_DIM=128 GROUP=4 WARPS=8 KV_TILE=64
// defines: HEAD_DIM=64 GROUP=7 WARPS=4 KV_TILE=64
// defines: HEAD_DIM=32 GROUP=3 WARPS=4 KV_TILE=64
// defines: HEAD_DIM=16 GROUP=2 WARPS=8 KV_TILE=64
#include "common.cuh"

#if !defined(HEAD_DIM) || !defined(GROUP) || !defined(WARPS) || !defined(KV_TILE)
#error "prefill_attn.cu needs HEAD_DIM, GROUP, WARPS and KV_TILE"
#endif
#define BLOCK_ROWS (16 * WARPS)
#define BLOCK_TOKENS (BLOCK_ROWS / GROUP)
// shared-memory rows are padded by 8 bf16 (16 bytes) so that ldmatrix reads hit no bank twice
#define ROW_STRIDE (HEAD_DIM + 8)
#define K_STEPS (HEAD_DIM / 16)  // k steps of the m16n8k16 mma over the head
#define DIM_TILES (HEAD_DIM / 8)  // n8 output tiles over the head
#define KEY_TILES (KV_TILE / 8)  // n8 score tiles over a K/V tile
#define STAGE_BYTES (2 * KV_TILE * ROW_STRIDE * 2)  // a K and a V tile of bf16 rows

static_assert(HEAD_DIM % 16 == 0 && HEAD_DIM <= 128, "head_dim must be a multiple of 16, at most 128");
static_assert(GROUP >= 1 && GROUP <= BLOCK_ROWS, "group size must be at most 16 * WARPS");
static_assert(KV_TILE % 16 == 0, "K/V tiles are whole k16 steps of the P x V product");
static_assert(WARPS <= 8, "launch bounds ask for 8 / WARPS blocks per SM");

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

// lo in the low half
__device__ __forceinline__ unsigned cvt_bf2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// q: [C, nh, HEAD_DIM] bf16, pre-scaled by hd^-0.5 * log2(e); k_cache, v_cache: this layer's
// [kv_heads, max_ctx, HEAD_DIM] bf16; out: [C, nh * HEAD_DIM] bf16. Grid (ceil(C / BLOCK_TOKENS), kv_heads),
// dynamic shared memory 2 * STAGE_BYTES (two stages)
extern "C" __global__ void __launch_bounds__(WARPS * 32, 8 / WARPS)
prefill_attn(int pos0, int T, const bf16* __restrict__ q, const bf16* __restrict__ k_cache,
             const bf16* __restrict__ v_cache, bf16* __restrict__ out, int max_ctx)
{
    extern __shared__ __align__(16) unsigned char smem[];
    const int t0 = (gridDim.x - 1 - blockIdx.x) * BLOCK_TOKENS;  // the longest tiles start first
    if (t0 >= T) return;
    const int kvh = blockIdx.y, nh = gridDim.y * GROUP;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gid = lane >> 2, tig = lane & 3;
    const int t_last = min(t0 + BLOCK_TOKENS, T) - 1;
    const int kv_len = pos0 + t_last + 1;

    // this lane's two rows; padding rows borrow the last token so that their math stays finite
    const int ra = warp * 16 + gid, rb = ra + 8;
    const int ta = min(t0 + ra / GROUP, t_last), tb = min(t0 + rb / GROUP, t_last);
    const int pa = pos0 + ta, pb = pos0 + tb;
    const bool va = ra < BLOCK_TOKENS * GROUP && t0 + ra / GROUP <= t_last;
    const bool vb = rb < BLOCK_TOKENS * GROUP && t0 + rb / GROUP <= t_last;
    const int wlo = pos0 + min(t0 + warp * 16 / GROUP, t_last);
    const int whi = pos0 + min(t0 + (warp * 16 + 15) / GROUP, t_last);
    const size_t oa = ((size_t)ta * nh + kvh * GROUP + ra % GROUP) * HEAD_DIM + tig * 2;
    const size_t ob = ((size_t)tb * nh + kvh * GROUP + rb % GROUP) * HEAD_DIM + tig * 2;

    unsigned qf[K_STEPS][4];
#pragma unroll
    for (int k = 0; k < K_STEPS; ++k) {
        qf[k][0] = *reinterpret_cast<const unsigned*>(q + oa + k * 16);
        qf[k][1] = *reinterpret_cast<const unsigned*>(q + ob + k * 16);
        qf[k][2] = *reinterpret_cast<const unsigned*>(q + oa + k * 16 + 8);
        qf[k][3] = *reinterpret_cast<const unsigned*>(q + ob + k * 16 + 8);
    }
    float o[DIM_TILES][4];
#pragma unroll
    for (int d = 0; d < DIM_TILES; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
    float ma = NEG_INF, mb = NEG_INF, la = 0.f, lb = 0.f;

    const bf16* kg = k_cache + (size_t)kvh * max_ctx * HEAD_DIM;
    const bf16* vg = v_cache + (size_t)kvh * max_ctx * HEAD_DIM;
    const unsigned sbase = (unsigned)__cvta_generic_to_shared(smem);
    // stage s: K [KV_TILE][ROW_STRIDE] then V [KV_TILE][ROW_STRIDE]
    auto load = [&](int tile, int stage) {
        const int n0 = tile * KV_TILE;
        for (int c = threadIdx.x; c < KV_TILE * HEAD_DIM / 8; c += WARPS * 32) {
            const int row = c / (HEAD_DIM / 8), col = c % (HEAD_DIM / 8) * 8;
            const bool ok = n0 + row < kv_len;
            const size_t off = ok ? (size_t)(n0 + row) * HEAD_DIM + col : 0;
            const unsigned dst = sbase + stage * STAGE_BYTES + (row * ROW_STRIDE + col) * 2;
            cp_async16(dst, kg + off, ok ? 16 : 0);
            cp_async16(dst + KV_TILE * ROW_STRIDE * 2, vg + off, ok ? 16 : 0);
        }
        cp_commit();
    };

    const int ntiles = (kv_len + KV_TILE - 1) / KV_TILE;
    load(0, 0);
    for (int it = 0; it < ntiles; ++it) {
        if (it + 1 < ntiles) {
            load(it + 1, (it + 1) & 1);
            cp_wait<1>();
        } else {
            cp_wait<0>();
        }
        __syncthreads();
        const int n0 = it * KV_TILE;
        if (n0 <= whi) {
            const unsigned sk = sbase + (it & 1) * STAGE_BYTES, sv = sk + KV_TILE * ROW_STRIDE * 2;
            float s[KEY_TILES][4];
#pragma unroll
            for (int n = 0; n < KEY_TILES; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
            for (int k = 0; k < K_STEPS; ++k) {
#pragma unroll
                for (int np = 0; np < KEY_TILES / 2; ++np) {
                    const int key = np * 16 + (lane >> 4) * 8 + (lane & 7);
                    const int dim = k * 16 + ((lane >> 3) & 1) * 8;
                    unsigned b0, b1, b2, b3;
                    ldsm4(sk + (key * ROW_STRIDE + dim) * 2, b0, b1, b2, b3);
                    mma_bf16(s[2 * np], qf[k], b0, b1);
                    mma_bf16(s[2 * np + 1], qf[k], b2, b3);
                }
            }
            if (n0 + KV_TILE - 1 > wlo) {
#pragma unroll
                for (int n = 0; n < KEY_TILES; ++n) {
                    const int key = n0 + n * 8 + tig * 2;
                    if (key > pa) s[n][0] = NEG_INF;
                    if (key + 1 > pa) s[n][1] = NEG_INF;
                    if (key > pb) s[n][2] = NEG_INF;
                    if (key + 1 > pb) s[n][3] = NEG_INF;
                }
            }
            float xa = ma, xb = mb;
#pragma unroll
            for (int n = 0; n < KEY_TILES; ++n) {
                xa = fmaxf(xa, fmaxf(s[n][0], s[n][1]));
                xb = fmaxf(xb, fmaxf(s[n][2], s[n][3]));
            }
            xa = fmaxf(xa, __shfl_xor_sync(0xffffffffu, xa, 1));
            xa = fmaxf(xa, __shfl_xor_sync(0xffffffffu, xa, 2));
            xb = fmaxf(xb, __shfl_xor_sync(0xffffffffu, xb, 1));
            xb = fmaxf(xb, __shfl_xor_sync(0xffffffffu, xb, 2));
            // key 0 is in every row's first tile, so xa, xb are finite from here on
            const float ca = fast_exp2(ma - xa), cb = fast_exp2(mb - xb);
            ma = xa;
            mb = xb;
            la *= ca;
            lb *= cb;
#pragma unroll
            for (int d = 0; d < DIM_TILES; ++d) {
                o[d][0] *= ca;
                o[d][1] *= ca;
                o[d][2] *= cb;
                o[d][3] *= cb;
            }
            unsigned pf[KV_TILE / 16][4];
#pragma unroll
            for (int n = 0; n < KEY_TILES; ++n) {
                const float p0 = fast_exp2(s[n][0] - ma), p1 = fast_exp2(s[n][1] - ma);
                const float p2 = fast_exp2(s[n][2] - mb), p3 = fast_exp2(s[n][3] - mb);
                la += p0 + p1;
                lb += p2 + p3;
                pf[n / 2][(n & 1) * 2] = cvt_bf2(p0, p1);
                pf[n / 2][(n & 1) * 2 + 1] = cvt_bf2(p2, p3);
            }
#pragma unroll
            for (int kk = 0; kk < KV_TILE / 16; ++kk) {
#pragma unroll
                for (int dp = 0; dp < DIM_TILES / 2; ++dp) {
                    const int key = kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7);
                    const int dim = dp * 16 + (lane >> 4) * 8;
                    unsigned b0, b1, b2, b3;
                    ldsm4_t(sv + (key * ROW_STRIDE + dim) * 2, b0, b1, b2, b3);
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
    for (int d = 0; d < DIM_TILES; ++d) {
        if (va) *reinterpret_cast<unsigned*>(out + oa + d * 8) = cvt_bf2(o[d][0] * ia, o[d][1] * ia);
        if (vb) *reinterpret_cast<unsigned*>(out + ob + d * 8) = cvt_bf2(o[d][2] * ib, o[d][3] * ib);
    }
}
