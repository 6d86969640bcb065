"""Safetensors loading into fused per-layer weights (QKV and gate/up fused once, at load)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class LayerWeights:
    attn_norm: np.ndarray  # [H]
    wqkv: np.ndarray  # [q_size + 2*kv_size, H]  rows: q, then k, then v
    bqkv: np.ndarray | None  # [q_size + 2*kv_size] (Qwen2) or None
    wo: np.ndarray  # [H, q_size]
    q_norm: np.ndarray | None  # [head_dim] (Qwen3) or None
    k_norm: np.ndarray | None  # [head_dim] (Qwen3) or None
    mlp_norm: np.ndarray  # [H]
    w_gate_up: np.ndarray  # [2*I, H]  rows: gate, then up
    w_down: np.ndarray  # [H, I]


@dataclass
class ModelWeights:
    """Arrays keep the checkpoint dtype: float32, float16 or ml_dtypes.bfloat16."""

    embed: np.ndarray  # [V, H]
    layers: list[LayerWeights]
    final_norm: np.ndarray  # [H]
    lm_head: np.ndarray  # [V, H]; the same array as embed when tied
