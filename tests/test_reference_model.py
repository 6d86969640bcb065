"""ReferenceModel end to end against a plain float64 transformer written out here, on random numpy
weights: prefill (all rows), prefill in pieces, and decode at several split counts.

The activations are small (mean square near rms_norm_eps), so eps is visible in every norm."""

import dataclasses
import math

import numpy as np
import pytest

from engine.config import ModelConfig, RopeScaling
from engine.errors import GDecodeError
from engine.reference import ReferenceModel
from engine.weights import LayerWeights, ModelWeights
from tests.test_reference import plain_inv_freq

EPS = 1e-2
VARIANTS = {
    # arch, tied, attention bias (q/k/v), o_proj bias, q/k norm, llama3 scaling, heads, kv heads
    "llama3": ("llama", False, False, True, False, True, 4, 2),
    "qwen2": ("qwen2", True, True, False, False, False, 6, 2),
    "qwen3": ("qwen3", False, False, False, True, False, 4, 1),
    "mha": ("mistral", False, False, False, False, False, 3, 3),
}


def make(name, rng):
    arch, tied, bias, bo, qk_norm, scaling, nh, nkv = VARIANTS[name]
    hd, h, inter, vocab = 8, 24, 40, 50
    cfg = ModelConfig(
        arch=arch, vocab_size=vocab, hidden_size=h, intermediate_size=inter, num_layers=2, num_heads=nh,
        num_kv_heads=nkv, head_dim=hd, rms_norm_eps=EPS, rope_theta=500.0, max_position_embeddings=64,
        tie_word_embeddings=tied, attention_bias=bias, qk_norm=qk_norm,
        rope_scaling=RopeScaling(4.0, 1.0, 4.0, 16) if scaling else None,
    )

    def mat(rows, cols, scale=1.0):
        return (rng.standard_normal((rows, cols)) * scale / math.sqrt(cols)).astype(np.float32)

    def vec(n, base=1.0, spread=0.5):
        return (base + spread * rng.standard_normal(n)).astype(np.float32)

    n_qkv = (nh + 2 * nkv) * hd
    layers = [
        LayerWeights(
            attn_norm=vec(h), wqkv=mat(n_qkv, h, 2.0), bqkv=vec(n_qkv, 0.0) if bias else None, wo=mat(h, nh * hd, 0.1),
            q_norm=vec(hd) if qk_norm else None, k_norm=vec(hd) if qk_norm else None, mlp_norm=vec(h),
            w_gate_up=mat(2 * inter, h, 2.0), w_down=mat(h, inter, 0.1), bo=vec(h, 0.0, 0.05) if bo else None,
        )
        for _ in range(cfg.num_layers)
    ]
    embed = (rng.standard_normal((vocab, h)) * 0.1).astype(np.float32)
    lm_head = embed if tied else mat(vocab, h)
    return cfg, ModelWeights(embed, layers, vec(h), lm_head)


def plain_logits(cfg, w, ids):
    """float64 logits [T, V] for ids at positions 0..T-1, one head and one position at a time."""
    f = {k: None if v is None else np.asarray(v, np.float64) for k, v in vars(w).items() if k != "layers"}
    nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    inv = plain_inv_freq(cfg)

    def norm(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.rms_norm_eps) * g

    def rope(x, pos):  # x: [heads, hd], pairs (i, i + hd/2)
        a, b = x[:, : hd // 2], x[:, hd // 2 :]
        c, s = np.cos(pos * inv), np.sin(pos * inv)
        return np.concatenate([a * c - b * s, b * c + a * s], axis=1)

    x = f["embed"][ids]
    t = len(ids)
    for lw in w.layers:
        L = {k: None if v is None else np.asarray(v, np.float64) for k, v in vars(lw).items()}
        qkv = norm(x, L["attn_norm"]) @ L["wqkv"].T + (0 if L["bqkv"] is None else L["bqkv"])
        q = qkv[:, : nh * hd].reshape(t, nh, hd)
        k = qkv[:, nh * hd : (nh + nkv) * hd].reshape(t, nkv, hd)
        v = qkv[:, (nh + nkv) * hd :].reshape(t, nkv, hd)
        if L["q_norm"] is not None:
            q, k = norm(q, L["q_norm"]), norm(k, L["k_norm"])
        q = np.stack([rope(q[p], p) for p in range(t)])
        k = np.stack([rope(k[p], p) for p in range(t)])
        out = np.zeros((t, nh, hd))
        for p in range(t):
            for head in range(nh):
                kv = head // (nh // nkv)
                sc = k[: p + 1, kv] @ q[p, head] / math.sqrt(hd)
                e = np.exp(sc - sc.max())
                out[p, head] = (e / e.sum()) @ v[: p + 1, kv]
        x = x + out.reshape(t, nh * hd) @ L["wo"].T + (0 if L["bo"] is None else L["bo"])
        gu = norm(x, L["mlp_norm"]) @ L["w_gate_up"].T
        gate, up = gu[:, : cfg.intermediate_size], gu[:, cfg.intermediate_size :]
        x = x + (gate / (1 + np.exp(-gate)) * up) @ L["w_down"].T
    return norm(x, f["final_norm"]) @ f["lm_head"].T


def close(got, want):
    """Relative error of each row of logits, against that row's spread."""
    got, want = np.atleast_2d(got), np.atleast_2d(want)
    return float((np.abs(got - want).max(axis=-1) / want.std(axis=-1)).max())


TOL = 2e-5


@pytest.fixture(params=list(VARIANTS))
def model(request):
    rng = np.random.default_rng(sorted(VARIANTS).index(request.param))
    cfg, w = make(request.param, rng)
    ids = [int(i) for i in rng.integers(0, cfg.vocab_size, 40)]
    return cfg, w, ids, plain_logits(cfg, w, ids)


def test_prefill_matches_plain_float64(model):
    cfg, w, ids, want = model
    ref = ReferenceModel(cfg, w, 48)
    got = ref.prefill(ids, return_all=True)
    assert got.dtype == np.float32 and got.shape == (len(ids), cfg.vocab_size) and ref.pos == len(ids)
    assert close(got, want) < TOL
    # eps is visible: the same model with eps x 2 is far outside the tolerance
    other = plain_logits(dataclasses.replace(cfg, rms_norm_eps=2 * EPS), w, ids)
    assert close(other, want) > 100 * TOL


def test_prefill_in_pieces_then_decode(model):
    cfg, w, ids, want = model
    for splits in (1, 3, 32):
        ref = ReferenceModel(cfg, w, 40, attn_splits=splits)
        assert close(ref.prefill(ids[:5]), want[4]) < TOL
        assert close(ref.prefill(ids[5:17], return_all=True), want[5:17]) < TOL
        for p in range(17, len(ids)):
            assert close(ref.decode(ids[p]), want[p]) < TOL, f"splits={splits} pos={p}"
        with pytest.raises(GDecodeError, match="not fit the context"):
            ref.decode(ids[0])
        ref.reset()
        assert ref.pos == 0 and close(ref.prefill(ids[:3], return_all=True), want[:3]) < TOL


def test_bad_arguments():
    cfg, w = make("llama3", np.random.default_rng(0))
    for ctx, splits in ((0, 1), (8, 0)):
        with pytest.raises(GDecodeError, match="must be >= 1"):
            ReferenceModel(cfg, w, ctx, attn_splits=splits)
    ref = ReferenceModel(cfg, w, 8)
    with pytest.raises(GDecodeError, match="at least one token"):
        ref.prefill([])
    with pytest.raises(GDecodeError, match="out of range"):
        ref.prefill([1, cfg.vocab_size])
    assert ref.pos == 0


def test_context_of_one_and_exact_messages():
    cfg, w = make("llama3", np.random.default_rng(1))
    ref = ReferenceModel(cfg, w, 1)
    assert close(ref.prefill([7]), plain_logits(cfg, w, [7])[0]) < TOL
    for ctx, splits in ((0, 1), (8, 0)):
        with pytest.raises(GDecodeError, match="^max_context and attn_splits must be >= 1$"):
            ReferenceModel(cfg, w, ctx, attn_splits=splits)
    with pytest.raises(GDecodeError, match="^prefill needs at least one token$"):
        ref.prefill(np.zeros(0, np.int64))


def test_ids_of_any_shape_and_integer_type():
    cfg, w = make("qwen2", np.random.default_rng(2))
    ids = [3, 1, 4, 1, 5, 9]
    want = ReferenceModel(cfg, w, 8).prefill(ids, return_all=True)
    got = ReferenceModel(cfg, w, 8).prefill(np.array(ids, np.int32).reshape(2, 3), return_all=True)
    assert np.array_equal(got, want)


def test_tied_config_uses_the_embedding():
    cfg, w = make("qwen2", np.random.default_rng(3))
    assert cfg.tie_word_embeddings
    other = ModelWeights(w.embed, w.layers, w.final_norm, (w.embed * 3 + 1).astype(np.float32))
    want = ReferenceModel(cfg, w, 8).prefill([1, 2])
    assert np.array_equal(ReferenceModel(cfg, other, 8).prefill([1, 2]), want)
    untied = dataclasses.replace(cfg, tie_word_embeddings=False)
    assert not np.array_equal(ReferenceModel(untied, other, 8).prefill([1, 2]), want)


def cast(w: ModelWeights, dtype) -> ModelWeights:
    def c(a):
        return None if a is None else a.astype(dtype)

    embed = c(w.embed)
    layers = [LayerWeights(**{k: c(a) for k, a in vars(lw).items()}) for lw in w.layers]
    return ModelWeights(embed, layers, c(w.final_norm), embed if w.lm_head is w.embed else c(w.lm_head))


def test_half_precision_weights_compute_in_float32():
    import ml_dtypes

    cfg, w = make("qwen3", np.random.default_rng(4))
    for dtype in (ml_dtypes.bfloat16, np.float16):
        half = cast(w, dtype)
        ref = ReferenceModel(cfg, half, 8)
        assert ref.embed.dtype == np.float32
        assert all(a.dtype == np.float32 for a in vars(ref.layers[0]).values() if a is not None)
        got = ref.prefill([5, 6, 7])
        assert got.dtype == np.float32
        assert np.array_equal(got, ReferenceModel(cfg, cast(half, np.float32), 8).prefill([5, 6, 7]))


def test_decode_runs_split_kv_and_prefill_runs_causal(monkeypatch):
    from engine import reference

    calls = []
    for name in ("split_kv_attention", "causal_attention"):
        real = getattr(reference, name)

        def spy(*args, _real=real, _name=name, **kw):
            calls.append((_name, args[3:], kw))
            return _real(*args, **kw)

        monkeypatch.setattr(reference, name, spy)
    cfg, w = make("mha", np.random.default_rng(5))
    ref = ReferenceModel(cfg, w, 16, attn_splits=3)
    ref.prefill([1, 2, 3])
    assert [c[0] for c in calls] == ["causal_attention"] * cfg.num_layers
    calls.clear()
    ref.decode(4)
    assert calls == [("split_kv_attention", (4, 3), {})] * cfg.num_layers
