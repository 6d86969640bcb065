"""Import a GGUF file as a Hugging Face model directory: bf16 safetensors, config and tokenizer."""

from __future__ import annotations

import json
import math
import shutil
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

from engine.errors import GDecodeError
from engine.gguf_config import (  # noqa: F401  (the public GGUF API, importable from here)
    ARCHITECTURES,
    SUPPORTED_TYPES,
    Entry,
    build_config,
    config_from_gguf,
    dequantize_tensor,
    layout,
    plan_tensors,
    read_metadata,
    unpermute,
)
from engine.gguf_mmap import read_gguf
from engine.gguf_outdir import check_outdir, import_signals, remove_stale, replace_dir, temp_dir
from engine.gguf_tokenizer import build_tokenizer, check_tokenizer, tokenizer_config, tokenizer_from_gguf  # noqa: F401


def to_bf16(e: Entry) -> np.ndarray:
    w = dequantize_tensor(e.tensor.data, e.tensor.tensor_type, e.shape)
    if e.unpermute_heads:
        w = unpermute(w, e.unpermute_heads)
    return w.astype(ml_dtypes.bfloat16)


def generation_config(cfg: dict) -> dict:
    return {k: cfg[k] for k in ("bos_token_id", "eos_token_id") if cfg[k] is not None}


def import_gguf(path: str | Path, outdir: str | Path, force: bool = False, progress: bool = True) -> Path:
    """Write OUTDIR from a GGUF file; nothing is left at OUTDIR unless the whole import succeeds.

    Everything is validated before anything is written. With force, OUTDIR may be an empty folder or
    an earlier import (it holds the marker file and only what an import writes); the GGUF file itself
    is only ever read.
    """
    path, outdir = Path(path), Path(outdir)
    source = str(path)
    f = read_gguf(path)
    cfg = config_from_gguf(f, source)
    plan = plan_tensors(cfg, f.tensors, source)
    tokenizer, tok_config = tokenizer_from_gguf(f, source)
    check_outdir(outdir, path, force)
    remove_stale(outdir.parent)
    with import_signals():
        tmp = temp_dir(outdir, source)
        try:
            write_safetensors(tmp / "model.safetensors", plan, progress)
            _write_json(tmp / "config.json", cfg)
            _write_json(tmp / "generation_config.json", generation_config(cfg))
            tokenizer.save(str(tmp / "tokenizer.json"))
            _write_json(tmp / "tokenizer_config.json", tok_config)
            replace_dir(tmp, outdir, path, force)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise GDecodeError(f"cannot write {outdir}: {e.strerror or e}") from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return outdir


def _write_json(path: Path, d: dict):
    path.write_text(json.dumps(d, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_safetensors(path: Path, plan: list[Entry], progress: bool = True):
    """Stream every tensor, dequantized to bf16, into one safetensors file (header first, then data)."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for e in plan:
        n = 2 * math.prod(e.shape)
        header[e.name] = {"dtype": "BF16", "shape": list(e.shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    console = Console(stderr=True)
    columns = (TextColumn("dequantizing"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
    with open(path, "wb") as f, Progress(*columns, console=console, disable=not progress) as bar:
        task = bar.add_task("", total=sum(e.tensor.n_bytes for e in plan))
        f.write(struct.pack("<Q", len(blob)) + blob)
        for e in plan:
            f.write(to_bf16(e).tobytes())
            bar.advance(task, e.tensor.n_bytes)
