#pragma once
// Weight formats of the GEMV: what a chunk is (the 16 bytes of weights one lane loads per step,
// plus the quantized formats' high bits and scales), how to load it, how to dot it with x, and how
// to dequantize it. The quantized rows are ggml blocks repacked at load (kernels/quant_layout.py
// describes the planes); every product uses ggml's own values: fp16 scales converted exactly, the
// small integer scales and quants exact in fp32. Dot products factor each (sub-)block's scale out
// of its sum, d * sum(q x) - m * sum(x), which changes only the order of the fp32 sums. With int8 x
// (dotq) the sums over a block are exact int32 dp4a's, offsets come out as off * sum(q_x), and the
// scales, mins and x's block scale are applied in fp32 per (sub-)block.
#include "common.cuh"

#ifndef K
#error "K (the row length) must be defined"
#endif

__device__ __forceinline__ float4 mul4(float4 a, float4 b) {
    return make_float4(a.x * b.x, a.y * b.y, a.z * b.z, a.w * b.w);
}

__device__ __forceinline__ float sum4(float4 v) { return (v.x + v.y) + (v.z + v.w); }

// weight loads: EARLY ones are coherent (ptxas keeps them above the PDL wait), the rest .nc
template <bool EARLY>
__device__ __forceinline__ uint4 load16(const unsigned char* p) {
    return EARLY ? ld_early(reinterpret_cast<const uint4*>(p)) : ld_stream(reinterpret_cast<const uint4*>(p));
}

template <bool EARLY>
__device__ __forceinline__ uint2 load8(const unsigned char* p) {
    uint2 r;
    if (EARLY)
        asm volatile("ld.global.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
    else
        asm("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
    return r;
}

template <bool EARLY>
__device__ __forceinline__ unsigned load4(const unsigned char* p) {
    unsigned r;
    if (EARLY)
        asm volatile("ld.global.L1::no_allocate.u32 %0, [%1];" : "=r"(r) : "l"(p));
    else
        asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(r) : "l"(p));
    return r;
}

template <bool EARLY>
__device__ __forceinline__ unsigned load2(const unsigned char* p) {
    unsigned short r;
    if (EARLY)
        asm volatile("ld.global.L1::no_allocate.u16 %0, [%1];" : "=h"(r) : "l"(p));
    else
        asm("ld.global.nc.L1::no_allocate.u16 %0, [%1];" : "=h"(r) : "l"(p));
    return r;
}

// ---- bf16 ----------------------------------------------------------------------------------------

__device__ __forceinline__ float dot8(const uint4 w, const float4 a, const float4 b, float acc) {
    acc = fmaf(bf_lo(w.x), a.x, acc);
    acc = fmaf(bf_hi(w.x), a.y, acc);
    acc = fmaf(bf_lo(w.y), a.z, acc);
    acc = fmaf(bf_hi(w.y), a.w, acc);
    acc = fmaf(bf_lo(w.z), b.x, acc);
    acc = fmaf(bf_hi(w.z), b.y, acc);
    acc = fmaf(bf_lo(w.w), b.z, acc);
    acc = fmaf(bf_hi(w.w), b.w, acc);
    return acc;
}

// rows of K bf16 values; a chunk is 8 of them
struct Bf16 {
    static constexpr int W = 8, REGS = 4, CHUNKS = K / 8;
    static constexpr size_t ROW_BYTES = (size_t)K * 2;
    static_assert(K % 8 == 0, "bf16 rows must be a multiple of 8");
    typedef uint4 Chunk;
    template <bool EARLY>
    static __device__ __forceinline__ Chunk load(const unsigned char* row, int k, bool ok) {
        return ok ? load16<EARLY>(row + 16 * (size_t)k) : make_uint4(0u, 0u, 0u, 0u);
    }
    template <bool EARLY>
    static __device__ __forceinline__ Chunk load_at(const unsigned char* row, int pass, int lane, bool ok) {
        return load<EARLY>(row, pass * 32 + lane, ok);
    }
    // chunks 32 (pass0 + u) + lane (QuantRows::load_run)
    template <bool EARLY, int N>
    static __device__ __forceinline__ void load_run(const unsigned char* row, int pass0, int lane, bool ok,
                                                    Chunk (&c)[N]) {
#pragma unroll
        for (int u = 0; u < N; ++u) c[u] = load_at<EARLY>(row, pass0 + u, lane, ok);
    }
    template <int R, class X>
    static __device__ __forceinline__ void dot(const Chunk (&c)[R], X& x, int k, float (&acc)[R]) {
        const float4 xa = x.get(k, 0), xb = x.get(k, 1);
#pragma unroll
        for (int j = 0; j < R; ++j) acc[j] = dot8(c[j], xa, xb, acc[j]);
    }
};

// ---- quantized ---------------------------------------------------------------------------------

// 2^23: a byte b placed in the mantissa of 2^23 reads as 2^23 + b, exactly
#define MAGIC 8388608.0f
// halves of a chunk whose x loads may be in flight at once: with both, the x and gamma loads of
// a whole chunk crowd the weights out of the register budget
#ifndef X_HALVES
#define X_HALVES 1
#endif

// byte b of v in the mantissa of 2^23 (the float 2^23 + v_b). An opaque volatile asm: the compiler
// would otherwise hoist the unpacking of whole chunks out of the loops into hundreds of registers
template <int B>
__device__ __forceinline__ float magic_byte(unsigned v) {
    unsigned r;
    asm volatile("prmt.b32 %0, %1, 0x4B000000, %2;" : "=r"(r) : "r"(v), "n"(0x7540 + B));
    return __uint_as_float(r);
}

// sum over the 4 bytes v_b of v of (v_b - off) x_b; magic_off = 2^23 + off
__device__ __forceinline__ float dot4(unsigned v, float4 x, float acc, float magic_off) {
    acc = fmaf(magic_byte<0>(v) - magic_off, x.x, acc);
    acc = fmaf(magic_byte<1>(v) - magic_off, x.y, acc);
    acc = fmaf(magic_byte<2>(v) - magic_off, x.z, acc);
    acc = fmaf(magic_byte<3>(v) - magic_off, x.w, acc);
    return acc;
}

// byte b of v minus off, as a float (exact)
__device__ __forceinline__ float byte_f(unsigned v, int b, float magic_off) {
    return __uint_as_float(__byte_perm(v, 0x4B000000u, 0x7540 + b)) - magic_off;
}

// the fp16 in the low half of h, exactly: its bits moved into an fp32 read 2^-112 times the value
// (subnormals too), then scaled back; full-rate integer and FMUL work, where cvt.f32.f16 is not
__device__ __forceinline__ float half_f(unsigned h) {
    const unsigned u = ((h & 0x7fffu) << 13) | ((h & 0x8000u) << 16);
    return __uint_as_float(u) * 0x1p112f;
}

__device__ __forceinline__ unsigned word_of(const uint4 q, int i) {
    return i == 0 ? q.x : i == 1 ? q.y : i == 2 ? q.z : q.w;
}

// words 2h and 2h + 1 of q (a select, not an index: a run-time index would put q in local memory)
__device__ __forceinline__ unsigned half_word(const uint4 q, int h, int i2) {
    return h ? (i2 ? q.w : q.z) : (i2 ? q.y : q.x);
}

// ---- int8 x (XQ) ----------------------------------------------------------------------------
// x quantized per 32 values as ggml's q8_1: 16-byte granules of int8, and per 32-block the fp32 scale
// and the int sums of q over each 16 (int16 pairs). The dot products are int32 dp4a's against the
// exact integer quants, then the (sub-)block scales and mins in fp32: W x^ with x^ = d_x q exactly,
// up to the fp32 rounding of the per-block terms.

// sum of the 4 signed bytes of a times those of b, plus c
__device__ __forceinline__ int dp4a(unsigned a, unsigned b, int c) { return __dp4a((int)a, (int)b, c); }

// a's bytes unsigned (0..255), b's signed
__device__ __forceinline__ int dp4a_us(unsigned a, unsigned b, int c) {
    int r;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}

__device__ __forceinline__ int lo16(unsigned v) { return (int)(v << 16) >> 16; }
__device__ __forceinline__ int hi16(unsigned v) { return (int)v >> 16; }
__device__ __forceinline__ int sbyte(unsigned v, int b) { return (int)(v << (24 - 8 * b)) >> 24; }
__device__ __forceinline__ int ubyte(unsigned v, int b) { return (v >> (8 * b)) & 0xffu; }

template <int N> struct Bytes { unsigned v; };  // 2 or 4 bytes
template <> struct Bytes<0> {};
template <> struct Bytes<8> { unsigned x, y; };

// N bytes at p, or zeros when !ok (a select per register: a select of whole structs can put them
// in local memory)
template <int N, bool EARLY>
__device__ __forceinline__ Bytes<N> load_bytes(const unsigned char* p, bool ok) {
    Bytes<N> r;
    if constexpr (N == 2) r.v = ok ? load2<EARLY>(p) : 0u;
    if constexpr (N == 4) r.v = ok ? load4<EARLY>(p) : 0u;
    if constexpr (N == 8) {
        r.x = ok ? load4<EARLY>(p) : 0u;
        r.y = ok ? load4<EARLY>(p + 4) : 0u;
    }
    return r;
}

// the B-byte side fields of N chunks that lie next to each other in a plane, in one load of B N bytes
// (4, 8, 16 or 32, aligned to 16 at most: QuantRows::load_run), or zeros when !ok
template <int B, int N, bool EARLY>
__device__ __forceinline__ void load_side_run(const unsigned char* p, bool ok, Bytes<B> (&out)[N]) {
    constexpr int T = B * N, WORDS = T / 4;
    unsigned w[WORDS];
    if constexpr (T == 4) {
        w[0] = ok ? load4<EARLY>(p) : 0u;
    } else if constexpr (T == 8) {
        const uint2 v = ok ? load8<EARLY>(p) : make_uint2(0u, 0u);
        w[0] = v.x, w[1] = v.y;
    } else {
#pragma unroll
        for (int i = 0; i < T / 16; ++i) {
            const uint4 v = ok ? load16<EARLY>(p + 16 * i) : make_uint4(0u, 0u, 0u, 0u);
            w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
        }
    }
#pragma unroll
    for (int u = 0; u < N; ++u) {
        if constexpr (B == 2) out[u].v = u % 2 ? w[u / 2] >> 16 : w[u / 2] & 0xffffu;
        if constexpr (B == 4) out[u].v = w[u];
        if constexpr (B == 8) out[u].x = w[2 * u], out[u].y = w[2 * u + 1];
    }
}

// The planes of a repacked row (kernels/quant_layout.py): Q (16 bytes per chunk), H (HB per chunk),
// S (SB per chunk), D (DB per ggml block of BLOCK weights), the row padded to 16 bytes. A row of whole
// groups of 4 passes of 32 chunks (LANE_MAJOR) orders each group's side entries by lane, then pass: chunk
// 32 p + l has its H and S bytes at entry 128 (p / 4) + 4 l + p % 4, and its block's D at entry
// (128 / PER_BLOCK) (p / 4) + 4 (l / PER_BLOCK) + p % 4. The side bytes of the chunks that one lane
// streams in 2 or 4 consecutive passes then lie together, and a warp's load of them is one contiguous span.
template <int W_, int BLOCK_, int HB, int SB, int DB>
struct QuantRows {
    static constexpr int W = W_, BLOCK = BLOCK_, CHUNKS = K / W_;
    static constexpr int PER_BLOCK = BLOCK_ / W_;  // chunks per ggml block
    static constexpr int REGS = 4 + (HB + 3) / 4 + (SB + 3) / 4 + (DB + 3) / 4;
    static constexpr size_t H_OFF = 16 * (size_t)CHUNKS, S_OFF = H_OFF + (size_t)HB * CHUNKS;
    static constexpr size_t D_OFF = (S_OFF + (size_t)SB * CHUNKS + 3) / 4 * 4;
    static constexpr size_t ROW_BYTES = (D_OFF + (size_t)DB * (K / BLOCK_) + 15) / 16 * 16;
    static constexpr bool LANE_MAJOR = CHUNKS % 128 == 0;
    static_assert(32 % PER_BLOCK == 0, "a ggml block's chunks share one lane group");
    struct Chunk {
        uint4 q;
        Bytes<HB> h;
        Bytes<SB> s;
        Bytes<DB> d;
    };
    // entry of chunk 32 pass + lane in the H and S planes, and of its block in the D plane
    static __device__ __forceinline__ int side_at(int pass, int lane) {
        return LANE_MAJOR ? pass / 4 * 128 + lane * 4 + pass % 4 : pass * 32 + lane;
    }
    static __device__ __forceinline__ int d_at(int pass, int lane) {
        return LANE_MAJOR ? pass / 4 * (128 / PER_BLOCK) + lane / PER_BLOCK * 4 + pass % 4
                          : (pass * 32 + lane) / PER_BLOCK;
    }
    // chunk 32 pass + lane
    template <bool EARLY>
    static __device__ __forceinline__ Chunk load_at(const unsigned char* row, int pass, int lane, bool ok) {
        static_assert(K % BLOCK_ == 0, "rows hold whole ggml blocks");
        Chunk c;
        c.q = ok ? load16<EARLY>(row + 16 * (size_t)(pass * 32 + lane)) : make_uint4(0u, 0u, 0u, 0u);
        if constexpr (HB > 0) c.h = load_bytes<HB, EARLY>(row + H_OFF + (size_t)HB * side_at(pass, lane), ok);
        if constexpr (SB > 0) c.s = load_bytes<SB, EARLY>(row + S_OFF + (size_t)SB * side_at(pass, lane), ok);
        c.d = load_bytes<DB, EARLY>(row + D_OFF + (size_t)DB * d_at(pass, lane), ok);
        return c;
    }
    template <bool EARLY>
    static __device__ __forceinline__ Chunk load(const unsigned char* row, int k, bool ok) {
        return load_at<EARLY>(row, k / 32, k % 32, ok);
    }
    // chunks 32 (pass0 + u) + lane (u < N) of one lane, pass0 a multiple of N: in a lane-major row, runs of
    // 2 or 4 passes load each side plane's fields for the N chunks at once (4 to 32 bytes, aligned to that)
    template <bool EARLY, int N>
    static __device__ __forceinline__ void load_run(const unsigned char* row, int pass0, int lane, bool ok,
                                                    Chunk (&c)[N]) {
        if constexpr (!LANE_MAJOR || (N != 2 && N != 4)) {
#pragma unroll
            for (int u = 0; u < N; ++u) c[u] = load_at<EARLY>(row, pass0 + u, lane, ok);
        } else {
#pragma unroll
            for (int u = 0; u < N; ++u)
                c[u].q = ok ? load16<EARLY>(row + 16 * (size_t)((pass0 + u) * 32 + lane)) : make_uint4(0u, 0u, 0u, 0u);
            if constexpr (HB > 0) {
                Bytes<HB> h[N];
                load_side_run<HB, N, EARLY>(row + H_OFF + (size_t)HB * side_at(pass0, lane), ok, h);
#pragma unroll
                for (int u = 0; u < N; ++u) c[u].h = h[u];
            }
            if constexpr (SB > 0) {
                Bytes<SB> s[N];
                load_side_run<SB, N, EARLY>(row + S_OFF + (size_t)SB * side_at(pass0, lane), ok, s);
#pragma unroll
                for (int u = 0; u < N; ++u) c[u].s = s[u];
            }
            Bytes<DB> d[N];
            load_side_run<DB, N, EARLY>(row + D_OFF + (size_t)DB * d_at(pass0, lane), ok, d);
#pragma unroll
            for (int u = 0; u < N; ++u) c[u].d = d[u];
        }
    }
};

// The 4-bit family: 32 weights per chunk; word i of Q holds weights 8i..8i+3 in its low nibbles and
// 8i+4..8i+7 in its high ones. HIGH: 0, 1 (Q5_*: bit 8b + 2i + t of H) or 2 bits (Q6_K: bits
// 8b + 2(2(i%2) + t) of H word i/2) on top, for half t and byte b.
enum Scaling { SCALE_D, SCALE_D_MIN, SCALE_DSC_DMIN, SCALE_DSC_PAIR };

template <int HIGH, int OFF, Scaling SC, int BLOCK, int SB, int DB>
struct Nibbles : QuantRows<32, BLOCK, HIGH == 0 ? 0 : HIGH == 1 ? 4 : 8, SB, DB> {
    typedef QuantRows<32, BLOCK, HIGH == 0 ? 0 : HIGH == 1 ? 4 : 8, SB, DB> Base;
    typedef typename Base::Chunk Chunk;
    static constexpr bool MINS = SC == SCALE_D_MIN || SC == SCALE_DSC_DMIN;

    // the 4 values of word i = 2h + i2, nibble t: the nibbles with the high bits moved on top
    static __device__ __forceinline__ unsigned values(const Chunk& c, int h, int i2, int t) {
        unsigned v = (half_word(c.q, h, i2) >> (4 * t)) & 0x0F0F0F0Fu;
        if constexpr (HIGH == 1) v |= ((c.h.v >> (4 * h + 2 * i2 + t)) & 0x01010101u) << 4;
        if constexpr (HIGH == 2) v |= (((h ? c.h.y : c.h.x) >> (2 * (2 * i2 + t))) & 0x03030303u) << 4;
        return v;
    }
    // (scale of weights 0..15, scale of weights 16..31, min) of a chunk
    static __device__ __forceinline__ void scales(const Chunk& c, float& s0, float& s1, float& m) {
        const float d = half_f(c.d.v);
        s0 = d;
        m = 0.f;
        if constexpr (SC == SCALE_D_MIN) m = half_f(c.d.v >> 16);
        if constexpr (SC == SCALE_DSC_DMIN) {  // s: (scale, min) bytes
            s0 = d * byte_f(c.s.v, 0, MAGIC);
            m = -(half_f(c.d.v >> 16) * byte_f(c.s.v, 1, MAGIC));
        }
        s1 = s0;
        if constexpr (SC == SCALE_DSC_PAIR) {  // s: two int8 scales, one per 16 weights
            s0 = d * byte_f(c.s.v ^ 0x8080u, 0, MAGIC + 128.0f);
            s1 = d * byte_f(c.s.v ^ 0x8080u, 1, MAGIC + 128.0f);
        }
    }
    template <int R, class X>
    static __device__ __forceinline__ void dot(const Chunk (&c)[R], X& x, int k, float (&acc)[R]) {
        float s0[R], s1[R], mn[R], sx = 0.f;
#pragma unroll
        for (int j = 0; j < R; ++j) scales(c[j], s0[j], s1[j], mn[j]);
#pragma unroll X_HALVES
        for (int h = 0; h < 2; ++h) {
            float p[R];
#pragma unroll
            for (int j = 0; j < R; ++j) p[j] = 0.f;
#pragma unroll
            for (int i2 = 0; i2 < 2; ++i2) {
                const float4 lo = x.get(k, 4 * h + 2 * i2), hi = x.get(k, 4 * h + 2 * i2 + 1);
                if (MINS) sx += sum4(lo) + sum4(hi);
#pragma unroll
                for (int j = 0; j < R; ++j) {
                    p[j] = dot4(values(c[j], h, i2, 0), lo, p[j], MAGIC + OFF);
                    p[j] = dot4(values(c[j], h, i2, 1), hi, p[j], MAGIC + OFF);
                }
            }
#pragma unroll
            for (int j = 0; j < R; ++j) acc[j] = fmaf(h ? s1[j] : s0[j], p[j], acc[j]);
        }
        if (MINS) {
#pragma unroll
            for (int j = 0; j < R; ++j) acc[j] = fmaf(mn[j], sx, acc[j]);
        }
    }
    // int8 x: granules 0, 1 of the chunk's x block (x words 2i, 2i + 1 meet word i's low, high nibbles)
    template <int R, class XL>
    static __device__ __forceinline__ void dotq(const Chunk (&c)[R], XL& x, int k, float (&acc)[R]) {
        const uint4 xa = x.granule(k, 0), xb = x.granule(k, 1);
        const uint2 mt = x.meta(k);
        const float dx = __uint_as_float(mt.x);
        const int sq0 = lo16(mt.y), sq1 = hi16(mt.y);
#pragma unroll
        for (int j = 0; j < R; ++j) {
            int p[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const uint4 xh = h ? xb : xa;
                if constexpr (HIGH == 0) {
                    // high nibbles in place: 16 times their dot, exactly
                    const unsigned w0 = half_word(c[j].q, h, 0), w1 = half_word(c[j].q, h, 1);
                    const int lo = dp4a(w1 & 0x0F0F0F0Fu, xh.z, dp4a(w0 & 0x0F0F0F0Fu, xh.x, 0));
                    const int hi = dp4a_us(w1 & 0xF0F0F0F0u, xh.w, dp4a_us(w0 & 0xF0F0F0F0u, xh.y, 0));
                    p[h] = lo + (hi >> 4);
                } else {
                    int s = dp4a(values(c[j], h, 0, 0), xh.x, 0);
                    s = dp4a(values(c[j], h, 0, 1), xh.y, s);
                    s = dp4a(values(c[j], h, 1, 0), xh.z, s);
                    p[h] = dp4a(values(c[j], h, 1, 1), xh.w, s);
                }
            }
            const float d = half_f(c[j].d.v);
            if constexpr (SC == SCALE_D) {
                acc[j] = fmaf(d * dx, (float)(p[0] + p[1] - OFF * (sq0 + sq1)), acc[j]);
            } else if constexpr (SC == SCALE_D_MIN) {
                const float m = half_f(c[j].d.v >> 16);
                acc[j] = fmaf(dx, fmaf(d, (float)(p[0] + p[1]), m * (float)(sq0 + sq1)), acc[j]);
            } else if constexpr (SC == SCALE_DSC_DMIN) {
                const float dmin = half_f(c[j].d.v >> 16);
                const int sc = ubyte(c[j].s.v, 0), mn = ubyte(c[j].s.v, 1);
                acc[j] = fmaf(dx, fmaf(d, (float)(sc * (p[0] + p[1])), -(dmin * (float)(mn * (sq0 + sq1)))), acc[j]);
            } else {
                const int t = sbyte(c[j].s.v, 0) * (p[0] - OFF * sq0) + sbyte(c[j].s.v, 1) * (p[1] - OFF * sq1);
                acc[j] = fmaf(d * dx, (float)t, acc[j]);
            }
        }
    }
    // value of weight 8i + 4t + b: scale * (v - OFF) [+ min], one exact product and one rounding
    static __device__ __forceinline__ void dequant(const Chunk& c, float (&out)[32]) {
        float s0, s1, m;
        scales(c, s0, s1, m);
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int i2 = 0; i2 < 2; ++i2)
#pragma unroll
                for (int t = 0; t < 2; ++t) {
                    const unsigned v = values(c, h, i2, t);
#pragma unroll
                    for (int b = 0; b < 4; ++b) {
                        const float q = byte_f(v, b, MAGIC + OFF);
                        out[16 * h + 8 * i2 + 4 * t + b] = MINS ? fmaf(h ? s1 : s0, q, m) : (h ? s1 : s0) * q;
                    }
                }
    }
};

// The 2-bit family (Q2_K, Q3_K): 64 weights per chunk, word i of Q is sub-block i (16 weights),
// weight 16i + 4s + b at bits 2s of byte b; Q3_K's third bit is bit 8b + 4(i%2) + s of H word i/2.
template <bool Q3>
struct Crumbs : QuantRows<64, 256, Q3 ? 8 : 0, 4, Q3 ? 2 : 4> {
    typedef QuantRows<64, 256, Q3 ? 8 : 0, 4, Q3 ? 2 : 4> Base;
    typedef typename Base::Chunk Chunk;
    static constexpr float OFF = Q3 ? 4.0f : 0.0f;

    // sub-block i = 2h + i2, shift s
    static __device__ __forceinline__ unsigned values(const Chunk& c, int h, int i2, int s) {
        unsigned v = (half_word(c.q, h, i2) >> (2 * s)) & 0x03030303u;
        if constexpr (Q3) v |= (((h ? c.h.y : c.h.x) >> (4 * i2 + s)) & 0x01010101u) << 2;
        return v;
    }
    // sub-block i = 2h + i2: d * scale and (Q2_K) -dmin * min
    static __device__ __forceinline__ void scales(const Chunk& c, int h, int i2, float& s, float& m) {
        const float d = half_f(c.d.v);
        const unsigned sb = c.s.v >> (16 * h);
        if constexpr (Q3) {
            s = d * byte_f(sb ^ 0x80808080u, i2, MAGIC + 128.0f);
            m = 0.f;
        } else {
            s = d * byte_f(sb & 0x0F0F0F0Fu, i2, MAGIC);
            m = -(half_f(c.d.v >> 16) * byte_f((sb >> 4) & 0x0F0F0F0Fu, i2, MAGIC));
        }
    }
    template <int R, class X>
    static __device__ __forceinline__ void dot(const Chunk (&c)[R], X& x, int k, float (&acc)[R]) {
#pragma unroll X_HALVES
        for (int h = 0; h < 2; ++h) {
#pragma unroll
            for (int i2 = 0; i2 < 2; ++i2) {
                float4 xs[4];
                float sx = 0.f;
#pragma unroll
                for (int s = 0; s < 4; ++s) {
                    xs[s] = x.get(k, 8 * h + 4 * i2 + s);
                    if (!Q3) sx += sum4(xs[s]);
                }
#pragma unroll
                for (int j = 0; j < R; ++j) {
                    float p = 0.f, sc, m;
#pragma unroll
                    for (int s = 0; s < 4; ++s) p = dot4(values(c[j], h, i2, s), xs[s], p, MAGIC + OFF);
                    scales(c[j], h, i2, sc, m);
                    acc[j] = fmaf(sc, p, acc[j]);
                    if (!Q3) acc[j] = fmaf(m, sx, acc[j]);
                }
            }
        }
    }
    // int8 x: granule i of the chunk is sub-block i's x; x blocks 2k, 2k + 1 hold sub-blocks 0-1, 2-3
    template <int R, class XL>
    static __device__ __forceinline__ void dotq(const Chunk (&c)[R], XL& x, int k, float (&acc)[R]) {
        uint4 xg[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) xg[i] = x.granule(k, i);
        const uint4 mt = x.meta2(k);
        const float dx[2] = {__uint_as_float(mt.x), __uint_as_float(mt.z)};
        const int sq[4] = {lo16(mt.y), hi16(mt.y), lo16(mt.w), hi16(mt.w)};
#pragma unroll
        for (int j = 0; j < R; ++j) {
            const float d = half_f(c[j].d.v);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                int a = 0, m = 0;
#pragma unroll
                for (int i2 = 0; i2 < 2; ++i2) {
                    const int i = 2 * h + i2;
                    int p = dp4a(values(c[j], h, i2, 0), xg[i].x, 0);
                    p = dp4a(values(c[j], h, i2, 1), xg[i].y, p);
                    p = dp4a(values(c[j], h, i2, 2), xg[i].z, p);
                    p = dp4a(values(c[j], h, i2, 3), xg[i].w, p);
                    const unsigned sb = c[j].s.v >> (8 * i);
                    if constexpr (Q3) {
                        a += sbyte(sb, 0) * (p - 4 * sq[i]);
                    } else {
                        a += (int)(sb & 15u) * p;
                        m += (int)((sb >> 4) & 15u) * sq[i];
                    }
                }
                if constexpr (Q3) {
                    acc[j] = fmaf(d * dx[h], (float)a, acc[j]);
                } else {
                    const float dmin = half_f(c[j].d.v >> 16);
                    acc[j] = fmaf(dx[h], fmaf(d, (float)a, -(dmin * (float)m)), acc[j]);
                }
            }
        }
    }
    static __device__ __forceinline__ void dequant(const Chunk& c, float (&out)[64]) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float sc, m;
            scales(c, i / 2, i % 2, sc, m);
#pragma unroll
            for (int s = 0; s < 4; ++s) {
                const unsigned v = values(c, i / 2, i % 2, s);
#pragma unroll
                for (int b = 0; b < 4; ++b) {
                    const float q = byte_f(v, b, MAGIC + OFF);
                    out[16 * i + 4 * s + b] = Q3 ? sc * q : fmaf(sc, q, m);
                }
            }
        }
    }
};

// Q8_0: 16 int8 weights per chunk (two chunks per block), in ggml's order
struct Q8_0 : QuantRows<16, 32, 0, 0, 2> {
    template <int R, class X>
    static __device__ __forceinline__ void dot(const Chunk (&c)[R], X& x, int k, float (&acc)[R]) {
        float p[R];
#pragma unroll
        for (int j = 0; j < R; ++j) p[j] = 0.f;
#pragma unroll X_HALVES
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int i2 = 0; i2 < 2; ++i2) {
                const float4 xi = x.get(k, 2 * h + i2);
#pragma unroll
                for (int j = 0; j < R; ++j) p[j] = dot4(half_word(c[j].q, h, i2) ^ 0x80808080u, xi, p[j], MAGIC + 128.0f);
            }
#pragma unroll
        for (int j = 0; j < R; ++j) acc[j] = fmaf(half_f(c[j].d.v), p[j], acc[j]);
    }
    // int8 x: granule k is half k % 2 of x block k / 2
    template <int R, class XL>
    static __device__ __forceinline__ void dotq(const Chunk (&c)[R], XL& x, int k, float (&acc)[R]) {
        const uint4 xg = x.granule(k, 0);
        const float dx = __uint_as_float(x.meta(k >> 1).x);
#pragma unroll
        for (int j = 0; j < R; ++j) {
            const int p = dp4a(c[j].q.w, xg.w, dp4a(c[j].q.z, xg.z, dp4a(c[j].q.y, xg.y, dp4a(c[j].q.x, xg.x, 0))));
            acc[j] = fmaf(half_f(c[j].d.v) * dx, (float)p, acc[j]);
        }
    }
    static __device__ __forceinline__ void dequant(const Chunk& c, float (&out)[16]) {
        const float d = half_f(c.d.v);
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int b = 0; b < 4; ++b) out[4 * i + b] = d * byte_f(word_of(c.q, i) ^ 0x80808080u, b, MAGIC + 128.0f);
    }
};

typedef Nibbles<0, 8, SCALE_D, 32, 0, 2> Q4_0;
typedef Nibbles<0, 0, SCALE_D_MIN, 32, 0, 4> Q4_1;
typedef Nibbles<1, 16, SCALE_D, 32, 0, 2> Q5_0;
typedef Nibbles<1, 0, SCALE_D_MIN, 32, 0, 4> Q5_1;
typedef Crumbs<false> Q2_K;
typedef Crumbs<true> Q3_K;
typedef Nibbles<0, 0, SCALE_DSC_DMIN, 256, 2, 4> Q4_K;
typedef Nibbles<1, 0, SCALE_DSC_DMIN, 256, 2, 4> Q5_K;
typedef Nibbles<2, 32, SCALE_DSC_PAIR, 256, 2, 2> Q6_K;
