from __future__ import annotations

from pathlib import Path

import typer

from cli.main import app
from engine.config import ModelConfig
from engine.llm import DEFAULT_MODEL
from engine.weights import checkpoint_bytes, load_weights, weight_arrays


def _gb(n: int) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


@app.command()
def info(model: Path = typer.Option(DEFAULT_MODEL, "--model", "-m", help="Hugging Face model directory.")):
    """Print a model's architecture, size and KV-cache cost per token."""
    cfg = ModelConfig.from_dir(model)
    w = load_weights(model, cfg)
    params = sum(a.size for a in weight_arrays(w))
    rows = [
        ("architecture", f"{cfg.arch} ({cfg.num_layers} layers, hidden {cfg.hidden_size}, "
                         f"ffn {cfg.intermediate_size})"),
        ("attention", f"{cfg.num_heads} heads / {cfg.num_kv_heads} kv heads, head_dim {cfg.head_dim}"),
        ("vocabulary", f"{cfg.vocab_size}" + (" (tied embeddings)" if cfg.tie_word_embeddings else "")),
        ("context", f"{cfg.max_position_embeddings} tokens, rope theta {cfg.rope_theta:g}"
         + (" (llama3 scaling)" if cfg.rope_scaling else "")),
        ("parameters", f"{params:,} ({params / 1e6:.1f} M)"),
        ("weight bytes", f"{_gb(checkpoint_bytes(w))} as stored ({w.embed.dtype}); "
         f"{_gb(2 * params)} in bf16"),
        ("KV bytes per token", f"{cfg.kv_bytes_per_token(2):,} (bf16)"),
    ]
    for k, v in rows:
        typer.echo(f"{k:>20}: {v}")
