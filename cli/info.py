from __future__ import annotations

from pathlib import Path

import typer

from cli.main import app
from engine.errors import GDecodeError
from engine.finite import first_nonfinite
from engine.llm import DEFAULT_MODEL
from engine.loader import load_model
from engine.qweights import device_bytes, elements, stored_bytes


def _gb(n: int) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


@app.command()
def info(
    model: Path = typer.Option(DEFAULT_MODEL, "--model", "-m", help="Hugging Face model directory or .gguf file."),
    check: bool = typer.Option(False, "--check", help="Also scan every weight for NaN or Inf."),
):
    """Print a model's architecture, size and KV-cache cost per token (for a GGUF: its tensor types)."""
    m = load_model(model, tokenizer=False)
    cfg, w = m.cfg, m.weights
    params = elements(w)
    stored = f"{_gb(stored_bytes(w))} as stored" + ("" if m.gguf else f" ({w.embed.dtype})")
    rows = [
        ("architecture", f"{cfg.arch} ({cfg.num_layers} layers, hidden {cfg.hidden_size}, "
                         f"ffn {cfg.intermediate_size})"),
        ("attention", f"{cfg.num_heads} heads / {cfg.num_kv_heads} kv heads, head_dim {cfg.head_dim}"),
        ("vocabulary", f"{cfg.vocab_size}" + (" (tied embeddings)" if cfg.tie_word_embeddings else "")),
        ("context", f"{cfg.max_position_embeddings} tokens, rope theta {cfg.rope_theta:g}"
         + (" (llama3 scaling)" if cfg.rope_scaling else "")),
        ("parameters", f"{params:,} ({params / 1e6:.1f} M)"),
        ("weight bytes", f"{stored}; {_gb(2 * params)} in bf16"),
        ("on the device", f"{_gb(device_bytes(w))} ({8 * device_bytes(w) / params:.2f} bits per weight)"),
        ("KV bytes per token", f"{cfg.kv_bytes_per_token(2):,} (bf16)"),
    ]
    if m.tensor_types:
        for name, (count, size) in m.tensor_types.items():
            rows.append((name, f"{count} tensor{'s' if count > 1 else ''}, {_gb(size)}"))
    for k, v in rows:
        typer.echo(f"{k:>20}: {v}")
    if check:
        bad = first_nonfinite(w)
        if bad is not None:
            name, n = bad
            raise GDecodeError(f"{model}: weight {name} holds {n} non-finite value{'s' * (n > 1)} (NaN or Inf)")
        typer.echo(f"{'weights':>20}: ok (every value finite)")
