"""`gdecode import-gguf`: a GGUF file to a Hugging Face model directory."""

from __future__ import annotations

import time
from pathlib import Path

import typer

from cli.main import app


@app.command("import-gguf")
def import_gguf(
    gguf_file: Path = typer.Argument(..., help="the .gguf file to read"),
    outdir: Path = typer.Argument(..., help="the model directory to write"),
    force: bool = typer.Option(False, "--force", help="replace OUTDIR if it is empty or an earlier import "
                               "(it holds a .gdecode-import marker and nothing else)"),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="show a progress bar"),
):
    """Dequantize a GGUF (llama, mistral, qwen2, qwen3) into bf16 safetensors, config.json and tokenizer.json."""
    from engine.gguf_import import import_gguf as run

    start = time.perf_counter()
    out = run(gguf_file, outdir, force=force, progress=progress)
    size = (out / "model.safetensors").stat().st_size / 2**20
    print(f"wrote {out} ({size:.0f} MiB bf16) in {time.perf_counter() - start:.1f} s")
