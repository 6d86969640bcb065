"""Named model shapes for benchmarks with random weights (no checkpoint needed)."""

from __future__ import annotations

from engine.config import ModelConfig, RopeScaling
from engine.errors import GDecodeError

_LLAMA3_SCALING = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                              original_max_position_embeddings=8192)
_LLAMA32_SCALING = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                               original_max_position_embeddings=8192)


def _shape(arch, layers, hidden, heads, kv_heads, head_dim, ffn, vocab, tied, theta, ctx, scaling=None):
    return ModelConfig(
        arch=arch, vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_layers=layers,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-5, rope_theta=theta,
        max_position_embeddings=ctx, tie_word_embeddings=tied, attention_bias=arch == "qwen2",
        qk_norm=arch == "qwen3", rope_scaling=scaling,
    )


SHAPES: dict[str, ModelConfig] = {
    "llama3-8b": _shape("llama", 32, 4096, 32, 8, 128, 14336, 128256, False, 500000.0, 131072, _LLAMA3_SCALING),
    "qwen2.5-7b": _shape("qwen2", 28, 3584, 28, 4, 128, 18944, 152064, False, 1000000.0, 32768),
    "qwen2.5-1.5b": _shape("qwen2", 28, 1536, 12, 2, 128, 8960, 151936, True, 1000000.0, 32768),
    "qwen2.5-0.5b": _shape("qwen2", 24, 896, 14, 2, 64, 4864, 151936, True, 1000000.0, 32768),
    "llama3.2-1b": _shape("llama", 16, 2048, 32, 8, 64, 8192, 128256, True, 500000.0, 131072, _LLAMA32_SCALING),
    "smollm2-135m": _shape("llama", 30, 576, 9, 3, 64, 1536, 49152, True, 100000.0, 8192),
}


def shape(name: str) -> ModelConfig:
    try:
        return SHAPES[name]
    except KeyError:
        raise GDecodeError(f"unknown shape {name!r} (choose from {', '.join(SHAPES)})") from None


def decode_bytes(cfg: ModelConfig, n_cached: int, weight_bytes: int = 2, kv_bytes: int = 2) -> int:
    """Bytes one decode step must read: every weight but the embedding table, plus n_cached K/V rows."""
    embed = cfg.vocab_size * cfg.hidden_size
    params = cfg.param_count() - embed + (embed if cfg.tie_word_embeddings else 0)
    return params * weight_bytes + n_cached * cfg.kv_bytes_per_token(kv_bytes)
