"""Each decode kernel against a numpy reference, on fresh random inputs at awkward sizes.

Outputs are poisoned with NaN before every run. Tolerances (relative L2 error unless stated):
fp32 GEMV/norm/attention math 2e-5 (float32 accumulation order), bf16 cache writes 1 bf16 ulp,
the embedding gather exact. The sampler: tests/test_sampler_gpu.py.
"""

import math

import ml_dtypes
import numpy as np
import pytest

from engine.reference import combine_splits, split_kv_partials
from graphs.buffers import STATE_DTYPE
from kernels.gemv_ops import EPI_ADD, EPI_GATE, EPI_SILU, EPI_STORE
from kernels.numerics import active_splits, rope_tables
from kernels.tuning import AttnTuning, GemvTuning
from tests.gemv_check import GemvCase, check, rel, rms

pytestmark = pytest.mark.gpu
BF16 = ml_dtypes.bfloat16
FP32_TOL = 2e-5


@pytest.fixture(scope="module")
def cp():
    import cupy

    from kernels.cuda import init

    init()
    return cupy


def bf16(a):
    """(bf16 bits for the device, the same values as float32 for numpy)."""
    b = np.asarray(a, np.float32).astype(BF16)
    return b.view(np.uint16), b.astype(np.float32)


def state(cp, **fields):
    st = np.zeros(1, STATE_DTYPE)
    st["ring_mask"] = 0
    for k, v in fields.items():
        st[k] = v
    return cp.asarray(st.view(np.uint8))


def run(cp, launch):
    launch(None)
    cp.cuda.get_current_stream().synchronize()


def norm_input(rng, shape, eps):
    """Input of a fused RMSNorm with mean square about 2 eps: dropping eps moves the output by ~20%,
    eps x 10 by half (against a 2e-5 tolerance)."""
    return (rng.standard_normal(shape) * math.sqrt(2 * eps)).astype(np.float32)


GEMV_CASES = [  # n_out, k, epi, norm, bias, splitk
    (576, 576, EPI_STORE, True, False, None),
    (896, 896, EPI_STORE, True, True, None),
    (1152, 896, EPI_STORE, True, True, 2),
    (896, 4864, EPI_ADD, False, True, None),
    (4864, 896, EPI_SILU, True, True, None),
    (4096, 4096, EPI_ADD, False, False, 4),
    (4096, 14336, EPI_ADD, False, True, None),
    (14336, 4096, EPI_SILU, True, False, 1),
    (320, 64, EPI_STORE, True, False, None),
    (96, 64, EPI_SILU, True, True, None),
    (64, 96, EPI_ADD, False, False, None),
    (1000, 72, EPI_STORE, False, True, 1),
    (1001, 896, EPI_GATE, True, True, None),
    (77, 4096, EPI_GATE, True, False, 2),
]


# pair: two consecutive rows per warp (each x load serves both), for the store and add epilogues
GEMV_PAIRED = [c + (False,) for c in GEMV_CASES] + [c + (True,) for c in GEMV_CASES if c[2] in (EPI_STORE, EPI_ADD)]


@pytest.mark.parametrize("blocks", [None, 3])
@pytest.mark.parametrize("warps,minb", [(8, 2), (4, 4)])
@pytest.mark.parametrize("n_out,k,epi,norm,bias,splitk,pair", GEMV_PAIRED)
def test_gemv(cp, rng, n_out, k, epi, norm, bias, splitk, pair, warps, minb, blocks):
    from kernels import ops

    if splitk is not None and splitk > warps:
        pytest.skip("more warps per row than per block")
    rows = 2 * n_out if epi == EPI_SILU else n_out
    wb, wf = bf16(rng.standard_normal((rows, k)) / math.sqrt(k))
    case = GemvCase(rng, wf, n_out, epi, norm, bias)
    w = cp.asarray(wb)
    tuning = GemvTuning(warps=warps, min_blocks=minb)
    err = check(cp, case, lambda x, g, b, y, amax: ops.gemv(w, x, y, n_out, k, gamma=g, bias=b, epi=epi, eps=case.eps,
                                                             amax=amax, splitk=splitk, blocks=blocks, pair=pair,
                                                             tuning=tuning), FP32_TOL)  # 3 blocks: many rows each
    print(f"gemv {n_out}x{k} epi={epi.name} norm={norm}: rel err {err:.2e}")


@pytest.mark.parametrize("n_out,k", [(2048, 2048), (896, 896), (4096, 4096)])
def test_gemv_whole_rows_before_the_wait(cp, rng, n_out, k):
    # o_proj's shapes: llama3.2-1b's (no split over K, every row in the first batch), qwen2.5-0.5b's, the 8B's
    from kernels import ops

    wb, wf = bf16(rng.standard_normal((n_out, k)) / math.sqrt(k))
    case = GemvCase(rng, wf, n_out, EPI_ADD, False, True)
    w = cp.asarray(wb)
    check(cp, case, lambda x, g, b, y, amax: ops.gemv(w, x, y, n_out, k, bias=b, epi=EPI_ADD, whole=True), FP32_TOL)


ROWS_CASES = [(1001, 896, True, True), (4099, 576, True, False), (50001, 64, False, True), (151936, 896, True, False),
              (3, 1024, True, True)]


@pytest.mark.parametrize("warps,minb", [(8, 2), (4, 4)])
@pytest.mark.parametrize("n_out,k,norm,bias", ROWS_CASES)
def test_gemv_rows_per_warp(cp, rng, n_out, k, norm, bias, warps, minb):
    from kernels import ops

    wb, wf = bf16(rng.standard_normal((n_out, k)) / math.sqrt(k))
    case = GemvCase(rng, wf, n_out, EPI_STORE, norm, bias)
    w = cp.asarray(wb)
    tuning = GemvTuning(warps=warps, min_blocks=minb)
    check(cp, case, lambda x, g, b, y, amax: ops.gemv(w, x, y, n_out, k, gamma=g, bias=b, eps=case.eps, amax=amax,
                                                       splitk=1, rows=4, tuning=tuning), FP32_TOL)


def _rope_cfg(nh, nkv, hd):
    from engine.config import ModelConfig, RopeScaling

    return ModelConfig(arch="llama", vocab_size=10, hidden_size=nh * hd, intermediate_size=8, num_layers=1,
                       num_heads=nh, num_kv_heads=nkv, head_dim=hd, rms_norm_eps=1e-6, rope_theta=500000.0,
                       max_position_embeddings=8192, tie_word_embeddings=False, attention_bias=False,
                       qk_norm=False, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64))


GEMV_ROPE_CASES = [  # nh, nkv, hd, k, bias, splitk
    (32, 8, 128, 4096, False, None),
    (14, 2, 64, 896, True, None),
    (14, 2, 64, 896, True, 1),
    (9, 3, 64, 576, False, 2),
    (4, 2, 16, 64, True, None),
]


@pytest.mark.parametrize("blocks", [None, 5])
@pytest.mark.parametrize("warps,minb", [(8, 2), (4, 4)])
@pytest.mark.parametrize("nh,nkv,hd,k,bias,splitk", GEMV_ROPE_CASES)
def test_gemv_rope(cp, rng, nh, nkv, hd, k, bias, splitk, warps, minb, blocks):
    from kernels import ops

    tuning = GemvTuning(warps=warps, min_blocks=minb)

    n = (nh + 2 * nkv) * hd
    ctx, eps = 200, 1e-5
    cos, sin = rope_tables(_rope_cfg(nh, nkv, hd).inv_freq(), ctx)
    d_cos, d_sin = cp.asarray(cos), cp.asarray(sin)
    wb, wf = bf16(rng.standard_normal((n, k)) / math.sqrt(k))
    d_w = cp.asarray(wb)
    g = (0.5 + rng.random(k)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    for pos in [0, 1, 77, ctx - 1, ctx + 40]:
        x = norm_input(rng, k, eps)
        full = wf.astype(np.float64) @ rms(x, g, eps) + (b if bias else 0)
        y = cp.full(n, np.nan, cp.float32)
        kc = cp.full(nkv * ctx * hd, 0x7FC0, cp.uint16)  # bf16 NaN
        vc = kc.copy()
        launch = ops.gemv_rope(d_w, cp.asarray(x), cp.asarray(g), cp.asarray(b) if bias else None, y,
                               state(cp, pos=pos), d_cos, d_sin, kc, vc, nh=nh, nkv=nkv, hd=hd, k=k, max_ctx=ctx,
                               eps=eps, splitk=splitk, blocks=blocks, tuning=tuning)
        run(cp, launch)
        p = min(pos, ctx - 1)
        q = _rope_ref(full[: nh * hd].reshape(nh, hd), None, cos[p], sin[p], eps)
        kk = _rope_ref(full[nh * hd : (nh + nkv) * hd].reshape(nkv, hd), None, cos[p], sin[p], eps)
        v = full[(nh + nkv) * hd :].reshape(nkv, hd)
        got = y.get()
        assert rel(got[: nh * hd].reshape(nh, hd), q) < FP32_TOL
        assert rel(got[nh * hd : (nh + nkv) * hd].reshape(nkv, hd), kk) < FP32_TOL
        assert rel(got[(nh + nkv) * hd :].reshape(nkv, hd), v) < FP32_TOL
        kg = kc.get().view(BF16).astype(np.float32).reshape(nkv, ctx, hd)
        vg = vc.get().view(BF16).astype(np.float32).reshape(nkv, ctx, hd)
        assert np.abs(kg[:, p] - kk).max() <= np.abs(kk).max() * 2**-7
        assert np.abs(vg[:, p] - v).max() <= np.abs(v).max() * 2**-7
        others = np.delete(np.arange(ctx), p)
        assert np.isnan(kg[:, others]).all() and np.isnan(vg[:, others]).all(), "wrote outside row pos"


@pytest.mark.parametrize("vocab,hidden", [(320, 64), (49152, 576), (1000, 4096)])
def test_embed(cp, rng, vocab, hidden):
    from kernels import ops

    tb, tf = bf16(rng.standard_normal((vocab, hidden)))
    table = cp.asarray(tb)
    x = cp.full(hidden, np.nan, cp.float32)
    for token, want in [(vocab - 1, vocab - 1), (7, 7), (vocab + 5, vocab - 1), (-3, 0)]:
        x.fill(np.nan)
        run(cp, ops.embed(table, state(cp, token=token), x, vocab, hidden))
        assert np.array_equal(x.get(), tf[want])


ROPE_CASES = [(9, 3, 64, False), (14, 2, 64, True), (32, 8, 128, False), (4, 2, 16, True), (12, 2, 128, True)]


@pytest.mark.parametrize("nh,nkv,hd,qk_norm", ROPE_CASES)
def test_rope_append(cp, rng, nh, nkv, hd, qk_norm):
    from engine.config import ModelConfig, RopeScaling
    from kernels import ops

    cfg = ModelConfig(arch="llama", vocab_size=10, hidden_size=nh * hd, intermediate_size=8, num_layers=1,
                      num_heads=nh, num_kv_heads=nkv, head_dim=hd, rms_norm_eps=1e-6, rope_theta=500000.0,
                      max_position_embeddings=8192, tie_word_embeddings=False, attention_bias=False,
                      qk_norm=qk_norm, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64))
    ctx, eps = 300, 1e-6
    cos, sin = rope_tables(cfg.inv_freq(), ctx)
    qn = (0.5 + rng.random(hd)).astype(np.float32)
    kn = (0.5 + rng.random(hd)).astype(np.float32)
    for pos in [0, 1, 77, ctx - 1, ctx + 40]:
        n = (nh + 2 * nkv) * hd
        qkv = norm_input(rng, n, eps) if qk_norm else rng.standard_normal(n).astype(np.float32)
        d_qkv = cp.asarray(qkv)
        kc = cp.full(nkv * ctx * hd, 0x7FC0, cp.uint16)  # bf16 NaN
        vc = kc.copy()
        launch = ops.rope_append(d_qkv, cp.asarray(qn) if qk_norm else None, cp.asarray(kn) if qk_norm else None,
                                 cp.asarray(cos), cp.asarray(sin), state(cp, pos=pos), kc, vc, nh=nh,
                                 kv_heads=nkv, hd=hd, max_ctx=ctx, eps=eps)
        run(cp, launch)
        p = min(pos, ctx - 1)
        v = qkv[(nh + nkv) * hd :].reshape(nkv, hd)
        q = _rope_ref(qkv[: nh * hd].reshape(nh, hd), qn if qk_norm else None, cos[p], sin[p], eps)
        k = _rope_ref(qkv[nh * hd : (nh + nkv) * hd].reshape(nkv, hd), kn if qk_norm else None, cos[p], sin[p], eps)
        assert rel(d_qkv.get()[: nh * hd].reshape(nh, hd), q) < FP32_TOL
        assert np.array_equal(d_qkv.get()[nh * hd :], qkv[nh * hd :]), "k/v part of qkv must stay"
        kg = kc.get().view(BF16).astype(np.float32).reshape(nkv, ctx, hd)
        vg = vc.get().view(BF16).astype(np.float32).reshape(nkv, ctx, hd)
        assert np.abs(kg[:, p] - k).max() <= np.abs(k).max() * 2**-7
        assert np.array_equal(vg[:, p], v.astype(BF16).astype(np.float32))
        others = np.delete(np.arange(ctx), p)
        assert np.isnan(kg[:, others]).all() and np.isnan(vg[:, others]).all(), "wrote outside row pos"


def _rope_ref(x, g, c, s, eps):
    x = x.astype(np.float64)
    if g is not None:
        x = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * g
    half = x.shape[-1] // 2
    x1, x2 = x[:, :half], x[:, half:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


ATTN_HEADS = [(9, 3, 64), (14, 2, 64), (32, 8, 128), (4, 1, 16), (8, 8, 128), (8, 4, 64)]


def _attn_rows(splits, top=300):
    """n_cached = k*chunk - 1, k*chunk, k*chunk + 1 for several chunk sizes, and n_cached < splits."""
    out = {1, 2, 3, splits - 1, splits, splits + 1, top}
    for chunk in (1, 2, 5, 9):
        for k in (1, splits // 2, splits - 1, splits):
            out |= {k * chunk - 1, k * chunk, k * chunk + 1}
    return sorted(n for n in out if 1 <= n <= top)


class AttnCase:
    """Cache, query and output buffers of one attention shape; cache rows past n_cached hold NaN."""

    def __init__(self, cp, rng, nh, kv_heads, hd, splits, ctx):
        self.cp, self.nh, self.kv_heads, self.hd, self.splits, self.ctx = cp, nh, kv_heads, hd, splits, ctx
        self.kb, self.kf = bf16(rng.standard_normal((kv_heads, ctx, hd)))
        self.vb, self.vf = bf16(rng.standard_normal((kv_heads, ctx, hd)))
        self.pm = cp.empty((nh, splits), cp.float32)
        self.pl, self.pacc = cp.empty_like(self.pm), cp.empty((nh, splits, hd), cp.float32)
        self.out = cp.empty(nh * hd, cp.float32)
        self.counters = cp.zeros(kv_heads, cp.uint32)

    def run(self, q, n_cached, tuning, k=None):
        """attn_decode at position n_cached - 1 (clamped by the kernel to the cache); returns out [nh, hd]."""
        from kernels.attention import attn_decode

        cp, rows = self.cp, min(n_cached, self.ctx)
        kp, vp = (self.kb if k is None else k).copy(), self.vb.copy()
        kp[:, rows:], vp[:, rows:] = 0x7FC0, 0x7FC0  # reading a row past the cached ones would show
        for a in (self.pm, self.pl, self.pacc, self.out):
            a.fill(np.nan)  # splits past the active ones keep NaN: merging one would show
        run(cp, attn_decode(cp.asarray(q), cp.asarray(kp), cp.asarray(vp), state(cp, pos=n_cached - 1), self.pm,
                            self.pl, self.pacc, self.out, self.counters, nh=self.nh, kv_heads=self.kv_heads,
                            hd=self.hd, splits=self.splits, max_ctx=self.ctx, tuning=tuning))
        assert (self.counters.get() == 0).all(), "the merging block resets its counter"
        return self.out.get().reshape(self.nh, self.hd)


@pytest.mark.parametrize("splits", [8, 32, 128])
@pytest.mark.parametrize("nh,nkv,hd", ATTN_HEADS)
def test_attention_chunk_boundaries(cp, rng, nh, nkv, hd, splits):
    """min_chunk 1: every split is active from n_cached = splits on, so chunk boundaries move with n_cached;
    the partials the merging block reads are checked too (they are left in pm, pl, pacc)."""
    case = AttnCase(cp, rng, nh, nkv, hd, splits, ctx=320)
    q = (rng.standard_normal(nh * hd) * 2).astype(np.float32)
    tuning = AttnTuning(min_chunk=1, one_split_rows=0)
    for n_cached in _attn_rows(splits):
        out = case.run(q, n_cached, tuning)
        active = active_splits(n_cached, splits, tuning, hd)
        m_ref, l_ref, acc_ref = split_kv_partials(q.reshape(nh, hd), case.kf, case.vf, n_cached, active)
        if active > 1:
            m = case.pm.get()[:, :active].T
            l, acc = case.pl.get()[:, :active].T, case.pacc.get()[:, :active].transpose(1, 0, 2)
            empty = l_ref == 0
            assert (np.isneginf(m[empty])).all() and (l[empty] == 0).all() and (acc[empty] == 0).all()
            live = ~empty
            assert np.allclose(m[live], m_ref[live], rtol=1e-5, atol=1e-5)
            assert rel(l[live], l_ref[live]) < FP32_TOL
            assert rel(acc[live], acc_ref[live]) < FP32_TOL
        ref = combine_splits(m_ref, l_ref, acc_ref)
        assert rel(out, ref) < FP32_TOL, f"n_cached={n_cached} active={active}"


@pytest.mark.parametrize("warps", [4, 8])
@pytest.mark.parametrize("splits,min_chunk", [(8, 1), (32, 4), (128, 2)])
@pytest.mark.parametrize("nh,nkv,hd", ATTN_HEADS)
def test_attention_decode_merges_active_splits(cp, rng, nh, nkv, hd, splits, min_chunk, warps):
    case = AttnCase(cp, rng, nh, nkv, hd, splits, ctx=320)
    tuning = AttnTuning(warps=warps, min_chunk=min_chunk, one_split_rows=0)
    for n_cached in _attn_rows(splits) + [case.ctx, case.ctx + 7]:
        q = (rng.standard_normal(nh * hd) * 2).astype(np.float32)
        out = case.run(q, n_cached, tuning)
        rows = min(n_cached, case.ctx)
        active = active_splits(rows, splits, tuning, hd)
        ref = combine_splits(*split_kv_partials(q.reshape(nh, hd), case.kf, case.vf, rows, active))
        assert rel(out, ref) < FP32_TOL, f"n_cached={n_cached} active={active}"


@pytest.mark.parametrize("nh,nkv,hd", [(9, 3, 64), (32, 8, 128)])
def test_attention_one_split_up_to_its_rows(cp, rng, nh, nkv, hd):
    """The default tuning: up to its one-split limit of cached rows the blocks write out directly and leave
    the partials alone (still NaN); past it the splits merge, and every output matches."""
    t = AttnTuning()
    splits, limit = 16, t.one_split_limit(hd)
    case = AttnCase(cp, rng, nh, nkv, hd, splits, ctx=limit + 64)
    for n_cached in (1, 63, 64, 65, limit - 1, limit, limit + 1, limit + 44):
        q = (rng.standard_normal(nh * hd) * 2).astype(np.float32)
        out = case.run(q, n_cached, t)
        active = active_splits(n_cached, splits, t, hd)
        assert (active == 1) == (n_cached <= limit)
        assert np.isnan(case.pl.get()).all() == (active == 1), f"n_cached={n_cached}: partials written or not"
        ref = combine_splits(*split_kv_partials(q.reshape(nh, hd), case.kf, case.vf, n_cached, active))
        assert rel(out, ref) < FP32_TOL, f"n_cached={n_cached} active={active}"


def _one_split_heads(group):
    """one_split_heads values for a group: 1, every other divisor, and 0 (the whole group)."""
    return [h for h in range(1, group) if group % h == 0] + [0]


@pytest.mark.parametrize("warps", [4, 8])
@pytest.mark.parametrize("splits", [1, 2, 16])
@pytest.mark.parametrize("nh,nkv,hd,heads", [(nh, nkv, hd, h) for nh, nkv, hd in ATTN_HEADS
                                             for h in _one_split_heads(nh // nkv)])
def test_attention_one_split_takes_query_heads_apart(cp, rng, nh, nkv, hd, heads, splits, warps):
    """One split over every row, its blocks taking `heads` query heads each (a block takes several shares
    in turn where the grid has fewer blocks than shares): every head's output matches, no partial is written."""
    t = AttnTuning(warps=warps, one_split_rows=320, one_split_heads=heads)
    case = AttnCase(cp, rng, nh, nkv, hd, splits, ctx=320)
    for n_cached in (1, 2, 17, 64, 129, 256, 320):
        q = (rng.standard_normal(nh * hd) * 2).astype(np.float32)
        out = case.run(q, n_cached, t)
        assert active_splits(n_cached, splits, t, hd) == 1
        assert np.isnan(case.pl.get()).all() and np.isnan(case.pacc.get()).all(), "no partial is written"
        ref = combine_splits(*split_kv_partials(q.reshape(nh, hd), case.kf, case.vf, n_cached, 1))
        assert rel(out, ref) < FP32_TOL, f"n_cached={n_cached}"


@pytest.mark.parametrize("ramp", [False, True])
@pytest.mark.parametrize("warps", [4, 8])
@pytest.mark.parametrize("nh,nkv,hd", [(32, 8, 128), (14, 2, 64)])
def test_attention_long_splits(cp, rng, nh, nkv, hd, warps, ramp):
    """Thousands of rows per split. With ramp, keys grow along the cache, so each warp's running max
    keeps rising far past its first rows (the kernel rescales only when it rises a lot)."""
    ctx, splits = 6000, 3
    case = AttnCase(cp, rng, nh, nkv, hd, splits, ctx)
    k = rng.standard_normal((nkv, ctx, hd))
    if ramp:
        k *= np.linspace(0.05, 4.0, ctx)[None, :, None]
    kb, kf = bf16(k)
    for rows in (5999, 4097, 1000):
        q = (rng.standard_normal(nh * hd) * (2.0 if ramp else 0.3)).astype(np.float32)
        out = case.run(q, rows, AttnTuning(warps=warps, min_chunk=1, one_split_rows=0), k=kb)
        ref = combine_splits(*split_kv_partials(q.reshape(nh, hd), kf, case.vf, rows, splits))
        assert rel(out, ref) < FP32_TOL, f"n_cached={rows}"


def test_fill_random(cp):
    from kernels import ops

    a = cp.empty((1000, 333), cp.uint16)
    ops.fill_bf16(a, 7, 0.5, 1.0)
    v = a.get().view(BF16).astype(np.float32)
    assert v.min() >= 0.5 and v.max() <= 1.5 and abs(v.mean() - 1.0) < 0.01 and v.std() > 0.2
    f = cp.empty(12345, cp.float32)
    ops.fill_f32(f, 7, 2.0)
    assert abs(float(f.mean())) < 0.1 and float(abs(f).max()) <= 2.0
