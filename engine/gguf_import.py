"""Import a GGUF file as a Hugging Face model directory: bf16 safetensors, config and tokenizer."""

from __future__ import annotations

import json
import math
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, ReaderTensor
from gguf.quants import dequantize
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

from engine.errors import GDecodeError
from engine.gguf_tokenizer import build_tokenizer, check_tokenizer, tokenizer_config

SUPPORTED_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


@dataclass
class Entry:
    name: str  # Hugging Face name
    tensor: ReaderTensor
    shape: tuple[int, ...]  # numpy order, rows first
    unpermute_heads: int = 0  # > 0: undo llama.cpp's rotary row order with this many heads


def open_gguf(path: Path) -> GGUFReader:
    """A GGUFReader on path, or GDecodeError when the file is missing, not GGUF, or cut short."""
    if not path.is_file():
        raise GDecodeError(f"{path}: no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GDecodeError(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    size = path.stat().st_size
    try:
        reader = GGUFReader(path)
    except Exception:  # the reader fails with assorted numpy errors on a damaged file
        raise GDecodeError(f"{path}: truncated or corrupt GGUF file ({size} bytes)") from None
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise GDecodeError(f"{path}: truncated GGUF file (tensor {t.name} runs past the end)")
    return reader


def read_metadata(reader: GGUFReader) -> dict:
    meta = {}
    for key, field in reader.fields.items():
        if not key.startswith("GGUF."):
            meta[key] = field.contents()
    return meta


def build_config(meta: dict, tensors: dict[str, ReaderTensor], source: str) -> dict:
    """config.json for the file's llama or qwen2 model."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GDecodeError(f"{source}: architecture {arch!r} is not supported (supported: llama, qwen2)")

    def get(key, default=None):
        v = meta.get(f"{arch}.{key}", default)
        if v is None:
            raise GDecodeError(f"{source}: no {arch}.{key} in the file")
        return v

    if "token_embd.weight" not in tensors:
        raise GDecodeError(f"{source}: no token_embd.weight tensor")
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    theta = float(get("rope.freq_base", 10000.0))
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
    cfg = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(get("context_length")),
        "rms_norm_eps": float(str(np.float32(get("attention.layer_norm_rms_epsilon")))),
        "rope_theta": theta,
        "rope_scaling": _rope_scaling(meta, tensors, arch, head_dim, theta, source),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(dict.fromkeys(eos)) if len(set(eos)) > 1 else (eos[0] if eos else None),
        "torch_dtype": "bfloat16",
    }
    if arch == "llama":
        cfg.update(attention_bias=False, mlp_bias=False)
    else:
        cfg.update(use_sliding_window=False)
    return cfg


def _rope_scaling(meta: dict, tensors: dict, arch: str, head_dim: int, theta: float, source: str) -> dict | None:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind not in ("none", "llama3"):
        raise GDecodeError(f"{source}: rope scaling {kind!r} is not supported (supported: none, llama3)")
    if "rope_freqs.weight" not in tensors:
        return None
    # Llama 3.x: llama.cpp stores per-frequency divisors instead of the scaling parameters
    _check_type(tensors["rope_freqs.weight"], source)
    factors = _dequant(tensors["rope_freqs.weight"]).reshape(-1).astype(np.float64)
    if np.allclose(factors, 1.0):
        return None
    scaling = {
        "rope_type": "llama3",
        "factor": float(factors.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": int(meta.get(f"{arch}.rope.scaling.original_context_length", 8192)),
    }
    expected = _llama3_factors(scaling, head_dim, theta)
    if factors.shape != expected.shape or not np.allclose(factors, expected, rtol=1e-3):
        raise GDecodeError(f"{source}: rope_freqs.weight does not match Llama 3 rope scaling (low 1, high 4)")
    return scaling


def _llama3_factors(s: dict, head_dim: int, theta: float) -> np.ndarray:
    # what llama.cpp's converter writes: the divisor of each rotary frequency
    old, low, high, factor = (
        s[k] for k in ("original_max_position_embeddings", "low_freq_factor", "high_freq_factor", "factor")
    )
    wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    smooth = (old / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, factor, mid))


def layout(cfg: dict) -> dict[str, tuple[str, tuple[int, ...]]]:
    """GGUF tensor name -> (Hugging Face name, numpy shape) for every tensor the model needs."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    out = {
        "token_embd.weight": ("model.embed_tokens.weight", (v, h)),
        "output_norm.weight": ("model.norm.weight", (h,)),
    }
    if not cfg["tie_word_embeddings"]:
        out["output.weight"] = ("lm_head.weight", (v, h))
    layer = {
        "attn_norm.weight": ("input_layernorm.weight", (h,)),
        "attn_q.weight": ("self_attn.q_proj.weight", (q, h)),
        "attn_k.weight": ("self_attn.k_proj.weight", (kv, h)),
        "attn_v.weight": ("self_attn.v_proj.weight", (kv, h)),
        "attn_output.weight": ("self_attn.o_proj.weight", (h, q)),
        "ffn_norm.weight": ("post_attention_layernorm.weight", (h,)),
        "ffn_gate.weight": ("mlp.gate_proj.weight", (i, h)),
        "ffn_up.weight": ("mlp.up_proj.weight", (i, h)),
        "ffn_down.weight": ("mlp.down_proj.weight", (h, i)),
    }
    if cfg["model_type"] == "qwen2":
        layer["attn_q.bias"] = ("self_attn.q_proj.bias", (q,))
        layer["attn_k.bias"] = ("self_attn.k_proj.bias", (kv,))
        layer["attn_v.bias"] = ("self_attn.v_proj.bias", (kv,))
    for n in range(cfg["num_hidden_layers"]):
        for key, (name, shape) in layer.items():
            out[f"blk.{n}.{key}"] = (f"model.layers.{n}.{name}", shape)
    return out


def plan_tensors(cfg: dict, tensors: dict[str, ReaderTensor], source: str) -> list[Entry]:
    """Every tensor to write, in Hugging Face names; checks names, shapes and types first."""
    want = layout(cfg)
    extra = sorted(set(tensors) - set(want) - {"rope_freqs.weight"})
    if extra:
        raise GDecodeError(f"{source}: unexpected tensor {extra[0]} for a {cfg['model_type']} model")
    # llama.cpp reorders Q and K rows for llama only (qwen2 uses the NeoX rotary layout as stored)
    heads = {"attn_q.weight": cfg["num_attention_heads"], "attn_k.weight": cfg["num_key_value_heads"]}
    plan = []
    for key, (name, shape) in want.items():
        t = tensors.get(key)
        if t is None:
            raise GDecodeError(f"{source}: missing tensor {key}")
        got = tuple(int(x) for x in reversed(t.shape))
        if got != shape:
            raise GDecodeError(f"{source}: tensor {key} has shape {list(got)}, expected {list(shape)}")
        _check_type(t, source)
        n_head = heads.get(key.split(".", 2)[-1], 0) if cfg["model_type"] == "llama" else 0
        plan.append(Entry(name, t, shape, n_head))
    return plan


def _check_type(t: ReaderTensor, source: str):
    if t.tensor_type not in SUPPORTED_TYPES:
        names = ", ".join(q.name for q in SUPPORTED_TYPES)
        raise GDecodeError(
            f"{source}: tensor {t.name} has unsupported quantization type {t.tensor_type.name} (supported: {names})"
        )


def dequantize_tensor(data: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> np.ndarray:
    """float32 values of one GGUF tensor's raw data, in numpy (rows-first) shape."""
    return np.asarray(dequantize(np.asarray(data), qtype), dtype=np.float32).reshape(shape)


def _dequant(t: ReaderTensor) -> np.ndarray:
    return dequantize_tensor(t.data, t.tensor_type, tuple(int(x) for x in reversed(t.shape)))


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order: it interleaves each head's two rotary halves row by row."""
    # llama.cpp: w.reshape(n_head, 2, rows/n_head/2, ...).swapaxes(1, 2); swapping back inverts it
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def to_bf16(e: Entry) -> np.ndarray:
    w = _dequant(e.tensor)
    if e.unpermute_heads:
        w = unpermute(w, e.unpermute_heads)
    return w.astype(ml_dtypes.bfloat16)


def generation_config(cfg: dict) -> dict:
    return {k: cfg[k] for k in ("bos_token_id", "eos_token_id") if cfg[k] is not None}


def import_gguf(path: str | Path, outdir: str | Path, force: bool = False, progress: bool = True) -> Path:
    """Write OUTDIR from a GGUF file; nothing is left at OUTDIR unless the whole import succeeds."""
    path, outdir = Path(path), Path(outdir)
    source = str(path)
    reader = open_gguf(path)
    meta = read_metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    cfg = build_config(meta, tensors, source)
    plan = plan_tensors(cfg, tensors, source)
    check_tokenizer(meta, source)
    if outdir.exists() and not force:
        raise GDecodeError(f"{outdir} already exists (pass --force to replace it)")
    if outdir.exists() and not outdir.is_dir():
        raise GDecodeError(f"{outdir} exists and is not a directory")
    tokenizer = build_tokenizer(meta, source)
    try:
        outdir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{outdir.name}.", suffix=".tmp", dir=outdir.parent))
    except OSError as e:
        raise GDecodeError(f"cannot write {outdir}: {e.strerror or e}") from None
    try:
        tmp.chmod(0o755)
        write_safetensors(tmp / "model.safetensors", plan, progress)
        _write_json(tmp / "config.json", cfg)
        _write_json(tmp / "generation_config.json", generation_config(cfg))
        tokenizer.save(str(tmp / "tokenizer.json"))
        _write_json(tmp / "tokenizer_config.json", tokenizer_config(meta, cfg["max_position_embeddings"]))
        _replace(tmp, outdir)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise GDecodeError(f"cannot write {outdir}: {e.strerror or e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return outdir


def _write_json(path: Path, d: dict):
    path.write_text(json.dumps(d, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _replace(tmp: Path, outdir: Path):
    if not outdir.exists():
        tmp.rename(outdir)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{outdir.name}.", suffix=".old", dir=outdir.parent))
    try:
        outdir.rename(old / "prev")
        try:
            tmp.rename(outdir)
        except BaseException:
            (old / "prev").rename(outdir)
            raise
    finally:
        shutil.rmtree(old, ignore_errors=True)


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
