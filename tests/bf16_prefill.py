"""A numpy emulation of the batched GPU prefill's roundings, the oracle of tests/test_prefill_gpu.py.

Beyond the float32 reference model, the prefill rounds to bf16: the RMSNorm outputs that feed the
GEMMs, the queries (after RoPE and the base-2 softmax scale), the K/V cache rows, the softmax
weights before the PV product (relative to the running max of each 64-key tile, as the flash
kernel keeps it) and the attention output and SiLU gate that feed the next GEMM. Everything else is
float32, as on the device. What remains between the device and this emulation is the float32
summation order, and the rare bf16 value that it tips to the other side of a rounding boundary.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from engine.config import ModelConfig
from engine.weights import ModelWeights
from kernels.numerics import LOG2E, rope_tables, softmax_scale2
from kernels.prefill_ops import ATTN_KV_TILE as TILE  # keys per flash-attention tile

# Relative L2 error allowed against this emulation: the first layer's K/V (only the float32 order of
# one GEMM lies before them), the later layers' K/V (rounding flips upstream move them by up to
# 1.8e-3 on the test models), the last token's logits (up to 4.6e-3). A 2% error in the softmax
# scale moves later K/V by >= 8e-3; eps x 10 moves the first layer's K/V by >= 3.2e-3.
FIRST_KV_TOL, KV_TOL, LOGIT_TOL = 5e-4, 4e-3, 1e-2


@dataclass
class Prefilled:
    k: np.ndarray  # [layers, n_kv, T, hd] float32 holding bf16 values
    v: np.ndarray  # [layers, n_kv, T, hd]
    logits: np.ndarray  # [vocab] of the last token, float32


def bf16(a) -> np.ndarray:
    """Round to bf16 (nearest even), returned as float32."""
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def _f32(a):
    return None if a is None else np.asarray(a, np.float32)


class _Math:
    """Products and sums in float32 (the device), or in float64 rounded once (another summation order)."""

    def __init__(self, wide: bool):
        self.wide = wide

    def mm(self, a, b):
        if self.wide:
            return (np.asarray(a, np.float64) @ np.asarray(b, np.float64)).astype(np.float32)
        return np.asarray(a, np.float32) @ np.asarray(b, np.float32)

    def mean_sq(self, x):
        return np.mean(x.astype(np.float64) ** 2 if self.wide else x * x, axis=-1, keepdims=True).astype(np.float32)

    def rms(self, x, g, eps):
        r = np.float32(1.0) / np.sqrt(self.mean_sq(x) + np.float32(eps))
        return x * r * g


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def _attention(q, k, v, m: _Math):
    """Causal flash attention of one kv head. q: [T, G, hd] bf16 values pre-scaled for exp2;
    k, v: [T, hd] bf16 values. Returns [T, G, hd] bf16 values."""
    t, g, hd = q.shape
    rows = q.reshape(t * g, hd)
    pos = np.repeat(np.arange(t), g)
    run_max = np.full(t * g, -np.inf, np.float32)
    total = np.zeros(t * g, np.float32)
    acc = np.zeros((t * g, hd), np.float32)
    for n0 in range(0, t, TILE):
        keys = np.arange(n0, min(n0 + TILE, t))
        s = m.mm(rows, k[keys].T)
        s = np.where(keys[None, :] > pos[:, None], np.float32(-np.inf), s)
        new_max = np.maximum(run_max, s.max(axis=-1))  # key 0 is in the first tile: finite from here on
        c = np.exp2(run_max - new_max)
        p = np.exp2(s - new_max[:, None])
        total = total * c + p.sum(axis=-1, dtype=np.float64 if m.wide else np.float32).astype(np.float32)
        acc = acc * c[:, None] + m.mm(bf16(p), v[keys])
        run_max = new_max
    return bf16(acc * (np.float32(1.0) / total)[:, None]).reshape(t, g, hd)


def prefill_bf16(cfg: ModelConfig, weights: ModelWeights, ids, *, scale: float | None = None,
                 wide: bool = False) -> Prefilled:
    """The K/V cache and last-token logits that the GPU prefill computes for `ids` at positions 0..T-1.

    `weights` should hold bf16 values (the device's weights). `scale` replaces the softmax scale
    hd^-0.5; `wide` does every product and sum in float64, rounding to float32 once, which shows how
    far a different summation order moves the result.
    """
    m = _Math(wide)
    ids = np.asarray(ids, np.int64).reshape(-1)
    t, hd, nh, nkv, eps = ids.size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.rms_norm_eps
    g, qs, kvs, inter = nh // nkv, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    qscale = np.float32(softmax_scale2(hd) if scale is None else scale * LOG2E)
    cos, sin = rope_tables(cfg.inv_freq(), t)
    cos, sin = cos[:, None, :], sin[:, None, :]
    x = _f32(weights.embed)[ids]
    ks, vs = [], []
    for lw in weights.layers:
        qkv = m.mm(bf16(m.rms(x, _f32(lw.attn_norm), eps)), _f32(lw.wqkv).T)
        if lw.bqkv is not None:
            qkv = qkv + _f32(lw.bqkv)
        q = qkv[:, :qs].reshape(t, nh, hd)
        k = qkv[:, qs : qs + kvs].reshape(t, nkv, hd)
        v = bf16(qkv[:, qs + kvs :].reshape(t, nkv, hd))
        if lw.q_norm is not None:
            q, k = m.rms(q, _f32(lw.q_norm), eps), m.rms(k, _f32(lw.k_norm), eps)
        q = bf16(_rotate(q, cos, sin) * qscale)
        k = bf16(_rotate(k, cos, sin))
        ks.append(k.transpose(1, 0, 2))
        vs.append(v.transpose(1, 0, 2))
        attn = np.empty((t, nh, hd), np.float32)
        for h in range(nkv):
            attn[:, h * g : (h + 1) * g] = _attention(q[:, h * g : (h + 1) * g], k[:, h], v[:, h], m)
        out = m.mm(attn.reshape(t, qs), _f32(lw.wo).T)
        x = x + (out if lw.bo is None else out + _f32(lw.bo))
        gu = m.mm(bf16(m.rms(x, _f32(lw.mlp_norm), eps)), _f32(lw.w_gate_up).T)
        gate, up = gu[:, :inter], gu[:, inter:]
        with np.errstate(over="ignore"):
            act = bf16(gate / (np.float32(1.0) + np.exp(-gate)) * up)
        x = x + m.mm(act, _f32(lw.w_down).T)
    # the logits come from the decode GEMV: its RMSNorm prologue stays float32
    last = m.rms(x[-1], _f32(weights.final_norm), eps)
    logits = m.mm(_f32(weights.lm_head), last)
    return Prefilled(np.stack(ks), np.stack(vs), logits)


def rel(a, b) -> float:
    """Relative L2 error of a against b (a must be finite)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.isfinite(a).all(), "non-finite values"
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def errors(k, v, logits, want: Prefilled) -> tuple[float, float, float]:
    """(first layer K/V, worst later layer K/V, logits) relative L2 errors of k, v [layers, n_kv, T, hd]
    and logits [vocab] against `want`; logits may be None (reported as 0)."""
    per_layer = [max(rel(k[i], want.k[i]), rel(v[i], want.v[i])) for i in range(want.k.shape[0])]
    return per_layer[0], max(per_layer[1:], default=0.0), 0.0 if logits is None else rel(logits, want.logits)


def within(errs: tuple[float, float, float]) -> bool:
    first, later, logits = errs
    return first < FIRST_KV_TOL and later < KV_TOL and logits < LOGIT_TOL
