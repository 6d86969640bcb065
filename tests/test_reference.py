"""Unit checks of the reference model's pieces: split-KV attention, RoPE, RMSNorm."""

import math

import numpy as np
import pytest

from engine.config import ModelConfig, RopeScaling
from engine.reference import (
    apply_rope,
    causal_attention,
    combine_splits,
    rms_norm,
    split_kv_attention,
    split_kv_partials,
)
from engine.shapes import SHAPES
from kernels.numerics import rope_tables


def plain_attention(q, k, v, nkv):
    """float64 softmax attention of q [nh, hd] over the first nkv rows of k, v [n_kv, S, hd]."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    g = q.shape[0] // k.shape[0]
    kk, vv = np.repeat(k[:, :nkv], g, axis=0), np.repeat(v[:, :nkv], g, axis=0)
    sc = np.einsum("hd,hnd->hn", q, kk) / math.sqrt(q.shape[1])
    p = np.exp(sc - sc.max(-1, keepdims=True))
    return np.einsum("hn,hnd->hd", p / p.sum(-1, keepdims=True), vv)


def boundary_nkvs(splits, top=200):
    """nkv at every chunk boundary +-1: the values where ceil(nkv/splits) changes."""
    out = set(range(1, splits + 2))
    for chunk in range(1, top // splits + 2):
        for n in (chunk * splits - 1, chunk * splits, chunk * splits + 1):
            if 1 <= n <= top:
                out.add(n)
    return sorted(out)


def qkv(rng, nh=8, n_kv=2, hd=16, s=200):
    q = rng.standard_normal((nh, hd)).astype(np.float32) * 2
    k = rng.standard_normal((n_kv, s, hd)).astype(np.float32) * 2
    v = rng.standard_normal((n_kv, s, hd)).astype(np.float32)
    return q, k, v


@pytest.mark.parametrize("splits", [1, 8, 32])
def test_split_kv_matches_softmax_at_chunk_boundaries(splits):
    rng = np.random.default_rng(splits)
    q, k, v = qkv(rng)
    for nkv in boundary_nkvs(splits):
        out = split_kv_attention(q, k, v, nkv, splits)
        ref = plain_attention(q, k, v, nkv)
        assert out.dtype == np.float32
        np.testing.assert_allclose(out, ref, rtol=0, atol=2e-5, err_msg=f"nkv={nkv}")


@pytest.mark.parametrize("splits,nkv", [(8, 3), (32, 1), (32, 5), (32, 31), (32, 33), (32, 65)])
def test_idle_splits_are_neutral(splits, nkv):
    rng = np.random.default_rng(nkv)
    q, k, v = qkv(rng, nh=7, n_kv=1)
    m, l, acc = split_kv_partials(q, k, v, nkv, splits)
    chunk = -(-nkv // splits)
    busy = -(-nkv // chunk)
    assert np.isfinite(m[:busy]).all() and (l[:busy] >= 1).all()
    assert np.isneginf(m[busy:]).all()
    assert (l[busy:] == 0).all() and (acc[busy:] == 0).all()
    # the partials of the busy splits alone give the same answer
    np.testing.assert_array_equal(combine_splits(m, l, acc), combine_splits(m[:busy], l[:busy], acc[:busy]))
    np.testing.assert_allclose(combine_splits(m, l, acc), plain_attention(q, k, v, nkv), atol=2e-5)


def test_partials_are_base2():
    rng = np.random.default_rng(0)
    q, k, v = qkv(rng, nh=2, n_kv=2, s=10)
    m, l, acc = split_kv_partials(q, k, v, 10, 2)
    sc = np.einsum("hd,hnd->hn", q.astype(np.float64), k[:, :5].astype(np.float64)) / 4 * math.log2(math.e)
    np.testing.assert_allclose(m[0], sc.max(-1), rtol=1e-5)
    np.testing.assert_allclose(l[0], np.exp2(sc - sc.max(-1, keepdims=True)).sum(-1), rtol=1e-5)


def test_explicit_scale():
    rng = np.random.default_rng(6)
    q, k, v = qkv(rng, s=40)
    for splits in (1, 8):
        out = split_kv_attention(q, k, v, 37, splits, scale=0.05)
        np.testing.assert_allclose(out, plain_attention(q * (0.05 * 4), k, v, 37), rtol=0, atol=2e-5)


def test_partials_are_float32_and_contiguous():
    rng = np.random.default_rng(7)
    q, k, v = (a.astype(np.float64) for a in qkv(rng, s=30))
    for a in split_kv_partials(q, k, v, 29, 8):
        assert a.dtype == np.float32 and a.flags.c_contiguous


def test_far_apart_heads_stay_finite():
    # one head's scores near 0, another's in the hundreds: each head must be shifted by its own max
    rng = np.random.default_rng(8)
    q, k, v = qkv(rng, nh=4, n_kv=2, s=50)
    q[0] *= 0.01
    q[1] *= 40
    for splits in (1, 4):
        out = split_kv_attention(q, k, v, 50, splits)
        np.testing.assert_allclose(out, plain_attention(q, k, v, 50), rtol=0, atol=2e-5)
    qt = np.stack([q * 0.01, q * 40, q])  # [T=3, nh, hd], positions 47..49
    out = causal_attention(qt, k, v, 47)
    for t in range(3):
        np.testing.assert_allclose(out[t], plain_attention(qt[t], k, v, 48 + t), rtol=0, atol=2e-5)


def test_silu_limits_without_warnings():
    import warnings

    from engine.reference import silu

    x = np.array([-1000.0, -100.0, 0.0, 3.0, 100.0], np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = silu(x)
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, [0.0, 0.0, 0.0, 3 / (1 + math.exp(-3)), 100.0], rtol=1e-6, atol=1e-30)


def test_split_kv_ignores_rows_past_nkv():
    rng = np.random.default_rng(1)
    q, k, v = qkv(rng)
    a = split_kv_attention(q, k, v, 50, 32)
    k[:, 50:], v[:, 50:] = 1e30, np.nan
    np.testing.assert_array_equal(a, split_kv_attention(q, k, v, 50, 32))


def test_causal_attention_last_row_matches_decode():
    rng = np.random.default_rng(2)
    q_all = rng.standard_normal((9, 8, 16)).astype(np.float32)
    _, k, v = qkv(rng, s=9)
    out = causal_attention(q_all, k, v, 0)
    for t in (0, 4, 8):
        np.testing.assert_allclose(out[t], plain_attention(q_all[t], k, v, t + 1), atol=2e-5)


def cfg(head_dim=16, theta=10000.0, scaling=None):
    return ModelConfig(
        arch="llama", vocab_size=32, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4,
        num_kv_heads=2, head_dim=head_dim, rms_norm_eps=1e-5, rope_theta=theta,
        max_position_embeddings=128, tie_word_embeddings=False, attention_bias=False, qk_norm=False,
        rope_scaling=scaling,
    )


def test_rope_rotate_half_layout():
    c = cfg()
    cos, sin = rope_tables(c.inv_freq(), 40)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((40, 3, 16)).astype(np.float32)
    y = apply_rope(x, cos, sin)
    # pair (i, i + hd/2) rotates by angle pos * inv_freq[i]
    ang = np.arange(40)[:, None] * c.inv_freq()[None, :]
    z = (x[..., :8] + 1j * x[..., 8:]) * np.exp(1j * ang)[:, None, :]
    np.testing.assert_allclose(y[..., :8], z.real, atol=1e-5)
    np.testing.assert_allclose(y[..., 8:], z.imag, atol=1e-5)
    np.testing.assert_array_equal(y[0], x[0])
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)


def test_rope_relative_position():
    cos, sin = rope_tables(cfg().inv_freq(), 64)
    rng = np.random.default_rng(4)
    q, k = rng.standard_normal((2, 1, 1, 16)).astype(np.float32)

    def dot(pq, pk):
        rq = apply_rope(q, cos[pq : pq + 1], sin[pq : pq + 1])
        rk = apply_rope(k, cos[pk : pk + 1], sin[pk : pk + 1])
        return float((rq * rk).sum())

    assert dot(10, 3) == pytest.approx(dot(47, 40), rel=1e-4)


def test_rope_llama3_scaling_changes_low_frequencies_only():
    s = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
    plain, scaled = cfg().inv_freq(), cfg(scaling=s).inv_freq()
    wl = 2 * np.pi / plain
    np.testing.assert_array_equal(scaled[wl < 16], plain[wl < 16])
    np.testing.assert_allclose(scaled[wl > 64], plain[wl > 64] / 8)
    mid = (wl >= 16) & (wl <= 64)
    assert mid.any() and ((scaled[mid] < plain[mid]) & (scaled[mid] > plain[mid] / 8)).all()
    cos, _ = rope_tables(cfg(scaling=s).inv_freq(), 5)
    np.testing.assert_allclose(cos[3], np.cos(3 * scaled), atol=1e-6)


def test_rms_norm():
    # rows from far below to far above sqrt(eps): eps is visible in the small ones (dropping it or
    # scaling it by 10 moves them by 2-50%), the big ones check the norm itself
    eps = 1e-5
    rng = np.random.default_rng(5)
    scales = np.array([0.0, 3e-4, 1e-3, 3e-3, 1e-2, 1.0, 7.0], np.float32)[:, None, None]
    x = (rng.standard_normal((7, 5, 64)) * scales).astype(np.float32)
    w = rng.uniform(0.5, 1.5, 64).astype(np.float32)
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + eps) * w
    y = rms_norm(x, w, eps)
    assert y.dtype == np.float32 and y.shape == x.shape
    np.testing.assert_allclose(y, ref, rtol=2e-6, atol=1e-7)
    assert (y[0] == 0).all()
    # the tolerance sees eps
    for wrong in (0.0, 10 * eps, 1.01 * eps):
        bad = x64[1:] / np.sqrt((x64[1:] ** 2).mean(-1, keepdims=True) + wrong) * w
        assert not np.allclose(bad, ref[1:], rtol=2e-6, atol=1e-7)


def plain_inv_freq(cfg):
    """RoPE inverse frequencies in float64, one at a time, with the llama3 rule written out."""
    out = []
    for i in range(0, cfg.head_dim, 2):
        f = 1.0 / cfg.rope_theta ** (i / cfg.head_dim)
        s = cfg.rope_scaling
        if s is not None:
            wavelen = 2 * math.pi / f
            if wavelen > s.original_max_position_embeddings / s.low_freq_factor:
                f = f / s.factor
            elif wavelen >= s.original_max_position_embeddings / s.high_freq_factor:
                smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
                    s.high_freq_factor - s.low_freq_factor)
                f = (1 - smooth) * f / s.factor + smooth * f
        out.append(f)
    return np.array(out)


LONG = [0, 1, 4095, 8191, 8192, 32767, 32768, 65537, 131071]
ROPE_ATOL = 1e-7  # float32 rounding of cos/sin is at most 3e-8


@pytest.mark.parametrize("name", ["llama3-8b", "llama3.2-1b", "qwen2.5-7b", "smollm2-135m"])
def test_rope_tables_at_long_positions(name):
    c = SHAPES[name]
    inv = plain_inv_freq(c)
    np.testing.assert_allclose(c.inv_freq(), inv, rtol=1e-13, atol=0)
    cos, sin = rope_tables(c.inv_freq(), 131072)
    assert cos.dtype == sin.dtype == np.float32 and cos.shape == sin.shape == (131072, c.head_dim // 2)
    pos = np.array(LONG, np.float64)[:, None]
    np.testing.assert_allclose(cos[LONG], np.cos(pos * inv), rtol=0, atol=ROPE_ATOL)
    np.testing.assert_allclose(sin[LONG], np.sin(pos * inv), rtol=0, atol=ROPE_ATOL)
    # an angle formed in float32 is off by far more than the tolerance from 8K positions on
    naive = np.cos(pos.astype(np.float32) * inv.astype(np.float32))
    assert np.abs(naive - np.cos(pos * inv))[3:].max(axis=1).min() > 100 * ROPE_ATOL

