"""The numpy float32 model: CPU backend and the oracle the GPU kernels are checked against."""

from __future__ import annotations

import numpy as np

from engine.config import ModelConfig
from engine.errors import GDecodeError, check_tokens
from engine.weights import LayerWeights, ModelWeights
from kernels.numerics import LOG2E, rope_tables

ATTN_SPLITS = 32


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x * rsqrt(mean(x^2) + eps) * w over the last axis, in float32."""
    ms = np.mean(x * x, axis=-1, keepdims=True, dtype=np.float32)
    return x * (np.float32(1.0) / np.sqrt(ms + np.float32(eps))) * w


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half (non-interleaved) RoPE. x: [T, n, hd]; cos, sin: [T, hd/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def split_kv_partials(q, k, v, n_cached: int, splits: int, scale: float | None = None):
    """The partial pass of split-KV decode attention over cache rows [0, n_cached).

    q: [nh, hd]; k, v: [kv_heads, >= n_cached, hd]. Split s covers rows [s*chunk, min((s+1)*chunk, n_cached))
    with chunk = ceil(n_cached / splits). Scores are scaled by scale*log2(e), so each split keeps
    m [splits, nh] (base-2 max), l [splits, nh] (sum of exp2(score - m)) and the unnormalised
    acc [splits, nh, hd]. An empty split has m = -inf, l = 0, acc = 0.
    """
    nh, hd = q.shape
    kv_heads = k.shape[0]
    g = nh // kv_heads
    scale = hd**-0.5 if scale is None else scale
    scale2 = np.float32(scale * LOG2E)
    chunk = -(-n_cached // splits)
    pad = splits * chunk - n_cached
    qg = q.reshape(kv_heads, g, hd)
    # sc: [kv_heads, g, splits, chunk]; rows past n_cached score -inf, so they (and empty splits) add nothing
    sc = np.matmul(qg, k[:, :n_cached].transpose(0, 2, 1)) * scale2
    sc = np.concatenate([sc, np.full((kv_heads, g, pad), -np.inf, np.float32)], axis=-1)
    sc = sc.reshape(kv_heads, g, splits, chunk)
    ms = sc.max(axis=-1)
    live = ms > -np.inf
    p = np.where(live[..., None], np.exp2(sc - np.where(live, ms, 0)[..., None]), np.float32(0))
    vp = np.concatenate([v[:, :n_cached], np.zeros((kv_heads, pad, hd), np.float32)], axis=1)
    vp = vp.reshape(kv_heads, splits, chunk, hd)
    # acc: [kv_heads, splits, g, hd]
    acc = np.matmul(p.transpose(0, 2, 1, 3), vp)
    m = np.ascontiguousarray(ms.reshape(nh, splits).T, dtype=np.float32)
    l = np.ascontiguousarray(p.sum(axis=-1).reshape(nh, splits).T, dtype=np.float32)
    acc = np.ascontiguousarray(acc.transpose(1, 0, 2, 3).reshape(splits, nh, hd), dtype=np.float32)
    return m, l, acc


def combine_splits(m: np.ndarray, l: np.ndarray, acc: np.ndarray) -> np.ndarray:
    """Merge split partials in the base-2 domain: out [nh, hd].

    lse_s = m_s + log2(l_s), M = max_s lse_s, w_s = exp2(lse_s - M),
    out = sum_s w_s * acc_s / l_s / sum_s w_s; empty splits (l = 0) get weight 0.
    """
    live = l > 0
    safe_l = np.where(live, l, np.float32(1.0))
    lse = np.where(live, m + np.log2(safe_l), np.float32(-np.inf))
    big = lse.max(axis=0)
    w = np.where(live, np.exp2(lse - big), np.float32(0.0))
    num = (w[..., None] * acc / safe_l[..., None]).sum(axis=0)
    return num / w.sum(axis=0)[:, None]


def split_kv_attention(q, k, v, n_cached: int, splits: int = ATTN_SPLITS, scale: float | None = None):
    """Decode attention of one query q [nh, hd] over k, v [kv_heads, >= n_cached, hd] -> [nh, hd]."""
    return combine_splits(*split_kv_partials(q, k, v, n_cached, splits, scale))


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int) -> np.ndarray:
    """Prefill attention. q: [T, nh, hd] at positions start..start+T-1; k, v: [kv_heads, start+T, hd]."""
    t, nh, hd = q.shape
    kv_heads, total, _ = k.shape
    g = nh // kv_heads
    # qg: [kv_heads, g, T, hd]
    qg = q.transpose(1, 0, 2).reshape(kv_heads, g, t, hd)
    sc = np.matmul(qg, k[:, None].transpose(0, 1, 3, 2)) * np.float32(hd**-0.5)
    future = np.arange(total)[None, :] > (start + np.arange(t))[:, None]
    sc = np.where(future, np.float32(-np.inf), sc)
    p = np.exp(sc - sc.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    out = np.matmul(p, v[:, None])
    return out.reshape(nh, t, hd).transpose(1, 0, 2)


def _f32(a):
    return None if a is None else np.ascontiguousarray(a, dtype=np.float32)


def silu(x: np.ndarray) -> np.ndarray:
    # exp(-x) overflows to inf for x < -88; x / inf = -0 is the right limit
    with np.errstate(over="ignore"):
        return x / (np.float32(1.0) + np.exp(-x))


class ReferenceModel:
    """Float32 numpy model with its own KV cache; decode attention is split-KV, as on the GPU."""

    def __init__(self, cfg: ModelConfig, weights: ModelWeights, max_context: int, attn_splits: int = ATTN_SPLITS):
        if max_context < 1 or attn_splits < 1:
            raise GDecodeError("max_context and attn_splits must be >= 1")
        self.cfg, self.max_context, self.attn_splits = cfg, max_context, attn_splits
        self.embed = _f32(weights.embed)
        tied = weights.lm_head is weights.embed or cfg.tie_word_embeddings
        self.lm_head = self.embed if tied else _f32(weights.lm_head)
        self.final_norm = _f32(weights.final_norm)
        self.layers = [LayerWeights(**{k: _f32(a) for k, a in vars(lw).items()}) for lw in weights.layers]
        self.cos, self.sin = rope_tables(cfg.inv_freq(), max_context)
        shape = (cfg.num_layers, cfg.num_kv_heads, max_context, cfg.head_dim)
        # k, v: [layers, kv_heads, max_context, hd]
        self.k = np.zeros(shape, np.float32)
        self.v = np.zeros(shape, np.float32)
        self.pos = 0

    def reset(self) -> None:
        """Forget the cached context (rows at or past `pos` are never read, so nothing is cleared)."""
        self.pos = 0

    def prefill(self, ids, return_all: bool = False) -> np.ndarray:
        """Append tokens at the current position; logits [V] of the last (or [T, V] with return_all)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise GDecodeError("prefill needs at least one token")
        x = self._run(ids, decode=False)
        return self._logits(x if return_all else x[-1])

    def decode(self, token_id: int) -> np.ndarray:
        """Run one token at the next position; logits [V]."""
        x = self._run(np.array([token_id], np.int64), decode=True)
        return self._logits(x[0])

    def _run(self, ids: np.ndarray, decode: bool) -> np.ndarray:
        start, t = self.pos, ids.size
        check_tokens(ids, self.cfg.vocab_size, self.max_context, start)
        x = self.embed[ids]
        for i, lw in enumerate(self.layers):
            x = self._layer(i, lw, x, start, decode)
        self.pos = start + t
        return x

    def _layer(self, i: int, lw: LayerWeights, x: np.ndarray, start: int, decode: bool) -> np.ndarray:
        cfg, t = self.cfg, x.shape[0]
        qs, kvs, hd, eps = cfg.q_size, cfg.kv_size, cfg.head_dim, cfg.rms_norm_eps
        qkv = rms_norm(x, lw.attn_norm, eps) @ lw.wqkv.T
        if lw.bqkv is not None:
            qkv = qkv + lw.bqkv
        q = qkv[:, :qs].reshape(t, cfg.num_heads, hd)
        k = qkv[:, qs : qs + kvs].reshape(t, cfg.num_kv_heads, hd)
        v = qkv[:, qs + kvs :].reshape(t, cfg.num_kv_heads, hd)
        if lw.q_norm is not None:
            q, k = rms_norm(q, lw.q_norm, eps), rms_norm(k, lw.k_norm, eps)
        cos, sin = self.cos[start : start + t], self.sin[start : start + t]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        end = start + t
        self.k[i, :, start:end] = k.transpose(1, 0, 2)
        self.v[i, :, start:end] = v.transpose(1, 0, 2)
        if decode:
            attn = split_kv_attention(q[0], self.k[i], self.v[i], end, self.attn_splits)[None]
        else:
            attn = causal_attention(q, self.k[i, :, :end], self.v[i, :, :end], start)
        out = attn.reshape(t, qs) @ lw.wo.T
        x = x + (out if lw.bo is None else out + lw.bo)
        gate_up = rms_norm(x, lw.mlp_norm, eps) @ lw.w_gate_up.T
        inter = cfg.intermediate_size
        return x + (silu(gate_up[:, :inter]) * gate_up[:, inter:]) @ lw.w_down.T

    def _logits(self, x: np.ndarray) -> np.ndarray:
        return rms_norm(x, self.final_norm, self.cfg.rms_norm_eps) @ self.lm_head.T
