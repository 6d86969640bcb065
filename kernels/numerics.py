"""Host-side math that the launch builders and the numpy reference must agree on (numpy and the tuning values)."""

from __future__ import annotations

import numpy as np

from kernels.tuning import AttnTuning

LOG2E = 1.4426950408889634  # attention scores are kept in the base-2 domain: exp(x) = exp2(x * LOG2E)


def softmax_scale2(head_dim: int) -> float:
    """The attention score scale for exp2: head_dim^-0.5 * log2(e)."""
    return head_dim**-0.5 * LOG2E


def rope_tables(inv_freq: np.ndarray, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin: [positions, len(inv_freq)] float32 (angles computed in float64)."""
    ang = np.arange(positions, dtype=np.float64)[:, None] * np.asarray(inv_freq, np.float64)[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def active_splits(n_cached: int, splits: int, attn: AttnTuning, head_dim: int) -> int:
    """Splits of decode attention that get rows, as attn_decode picks them under `attn`: one up to
    attn.one_split_limit(head_dim) cached rows, else at most `splits`, each with at least attn.min_chunk rows."""
    if n_cached <= attn.one_split_limit(head_dim):
        return 1
    return max(1, min(splits, -(-n_cached // attn.min_chunk)))
