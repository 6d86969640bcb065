"""A GGUF file's metadata as a Hugging Face config.json, and the tensors that config needs."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, ReaderTensor
from gguf.quants import dequantize

from engine.config import ModelConfig
from engine.errors import GDecodeError
from engine.gguf_mmap import GGUFFile

SUPPORTED_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
# general.architecture -> Hugging Face architecture; llama.cpp writes Mistral 7B and its kin as "llama"
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_INT_LIMIT = 1 << 31  # no size or id of a supported model comes near this
_BLOCK = re.compile(r"blk\.(\d+)\.")


@dataclass
class Entry:
    name: str  # Hugging Face name
    tensor: ReaderTensor
    shape: tuple[int, ...]  # numpy order, rows first
    unpermute_heads: int = 0  # > 0: undo llama.cpp's rotary row order with this many heads


class Metadata:
    """Typed, range-checked reads of GGUF metadata; every failure names the key, on one line."""

    def __init__(self, meta: dict, source: str):
        self.meta, self.source = meta, source

    def _bad(self, key: str, why: str):
        raise GDecodeError(f"{self.source}: metadata {key} {why}")

    def get(self, key: str, default=None):
        return self.meta.get(key, default)

    def int(self, key: str, default=None, lo: int = 1, hi: int = _INT_LIMIT) -> int | None:
        v = self.meta.get(key, default)
        if v is None:
            return None
        if type(v) is not int:
            self._bad(key, f"must be an integer, not {_kind(v)}")
        if not lo <= v <= hi:
            self._bad(key, f"is {v}, outside [{lo}, {hi}]")
        return v

    def float(self, key: str, default=None, lo: float = 0.0, hi: float = math.inf) -> float | None:
        v = self.meta.get(key, default)
        if v is None:
            return None
        if type(v) not in (int, float):
            self._bad(key, f"must be a number, not {_kind(v)}")
        if not (math.isfinite(v) and lo < v < hi):
            self._bad(key, f"is {v}, outside ({lo}, {hi})")
        return float(v)

    def bool(self, key: str, default: bool) -> bool:
        v = self.meta.get(key, default)
        if type(v) is not bool:
            self._bad(key, f"must be a boolean, not {_kind(v)}")
        return v

    def str(self, key: str, default=None) -> str | None:
        v = self.meta.get(key, default)
        if v is not None and type(v) is not str:
            self._bad(key, f"must be a string, not {_kind(v)}")
        return v

    def strings(self, key: str) -> list[str] | None:
        v = self.meta.get(key)
        if v is None:
            return None
        if type(v) is not list or not all(type(x) is str for x in v):
            self._bad(key, "must be an array of strings")
        return v

    def numbers(self, key: str, kind: type, n: int) -> list | None:
        v = self.meta.get(key)
        if v is None:
            return None
        ok = int if kind is int else (int, float)
        if type(v) is not list or not all(isinstance(x, ok) and type(x) is not bool for x in v):
            self._bad(key, f"must be an array of {'integers' if kind is int else 'numbers'}")
        if len(v) != n:
            self._bad(key, f"has {len(v)} entries for {n} tokens")
        return v


def _kind(v) -> str:
    return {bool: "a boolean", str: "a string", list: "an array", float: "a float", int: "an integer"}.get(
        type(v), type(v).__name__
    )


def read_metadata(reader: GGUFFile | GGUFReader) -> dict:
    """Key -> value (int, float, bool, str or list) of every metadata entry of a parsed GGUF file."""
    if isinstance(reader, GGUFFile):
        return reader.meta
    meta = {}
    for key, field in reader.fields.items():
        if not key.startswith("GGUF."):
            try:
                meta[key] = field.contents()
            except (UnicodeDecodeError, ValueError, IndexError):
                raise GDecodeError(f"corrupt GGUF metadata value {key}") from None
    return meta


def tensors_of(reader: GGUFFile | GGUFReader) -> dict[str, ReaderTensor]:
    """GGUF tensor name -> tensor, in file order."""
    return reader.tensors if isinstance(reader, GGUFFile) else {t.name: t for t in reader.tensors}


def config_from_gguf(reader: GGUFFile | GGUFReader, source: str = "GGUF file") -> dict:
    """config.json (a dict) for a parsed GGUF file's llama, mistral, qwen2 or qwen3 model, validated.

    reader is engine.gguf_mmap.read_gguf(path) (or a gguf.GGUFReader).
    `ModelConfig.from_dict(config_from_gguf(reader, source))` gives the model's config; every bad or
    missing value raises GDecodeError naming the metadata key.
    """
    cfg = build_config(read_metadata(reader), tensors_of(reader), source)
    ModelConfig.from_dict(cfg, source=source)
    return cfg


def build_config(meta: dict, tensors: dict[str, ReaderTensor], source: str) -> dict:
    """config.json for metadata meta and the file's tensors (by GGUF name); see config_from_gguf."""
    m = Metadata(meta, source)
    arch = m.str("general.architecture")
    if arch not in ARCHITECTURES:
        names = ", ".join(ARCHITECTURES)
        raise GDecodeError(f"{source}: architecture {arch!r} is not supported (supported: {names})")
    if "token_embd.weight" not in tensors:
        raise GDecodeError(f"{source}: no token_embd.weight tensor")

    def need(key, value):
        if value is None:
            raise GDecodeError(f"{source}: no {arch}.{key} in the file")
        return value

    blocks = {int(b.group(1)) for b in map(_BLOCK.match, tensors) if b}
    layers = need("block_count", m.int(f"{arch}.block_count"))
    if layers != len(blocks) or blocks != set(range(layers)):
        raise GDecodeError(f"{source}: {arch}.block_count is {layers}, but the file has tensors for "
                           f"{len(blocks)} blocks")
    hidden = need("embedding_length", m.int(f"{arch}.embedding_length"))
    heads = need("attention.head_count", m.int(f"{arch}.attention.head_count", hi=hidden))
    kv_heads = m.int(f"{arch}.attention.head_count_kv", heads, hi=heads)
    if heads % kv_heads:
        raise GDecodeError(f"{source}: {arch}.attention.head_count {heads} is not a multiple of "
                           f"head_count_kv {kv_heads}")
    if m.get(f"{arch}.attention.key_length") is None and hidden % heads:
        raise GDecodeError(f"{source}: {arch}.embedding_length {hidden} is not a multiple of head_count {heads}")
    head_dim = m.int(f"{arch}.attention.key_length", hidden // heads)
    value_dim = m.int(f"{arch}.attention.value_length", head_dim)
    if value_dim != head_dim or head_dim % 2:
        raise GDecodeError(f"{source}: head size {head_dim} (value size {value_dim}) must be even and equal")
    rope_dim = m.int(f"{arch}.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise GDecodeError(f"{source}: partial rotary embedding ({rope_dim} of {head_dim}) is not supported")
    theta = m.float(f"{arch}.rope.freq_base", 10000.0)
    eps = need("attention.layer_norm_rms_epsilon", m.float(f"{arch}.attention.layer_norm_rms_epsilon", hi=1.0))
    vocab = int(tensors["token_embd.weight"].shape[1])
    ids = [m.int(f"tokenizer.ggml.{k}_token_id", lo=0, hi=vocab - 1) for k in ("eos", "eot", "eom")]
    eos = list(dict.fromkeys(i for i in ids if i is not None))
    cfg = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": need("feed_forward_length", m.int(f"{arch}.feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": need("context_length", m.int(f"{arch}.context_length")),
        # the float32 value as its shortest decimal: 1e-05, not 9.999999747378752e-06
        "rms_norm_eps": float(str(np.float32(eps))),
        "rope_theta": theta,
        "rope_scaling": _rope_scaling(m, tensors, arch, head_dim, theta, source),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": m.int("tokenizer.ggml.bos_token_id", lo=0, hi=vocab - 1),
        "eos_token_id": eos if len(eos) > 1 else (eos[0] if eos else None),
        "torch_dtype": "bfloat16",
    }
    if arch == "llama":
        bias = "blk.0.attn_q.bias" in tensors
        cfg.update(attention_bias=bias, mlp_bias=False)
    else:
        cfg.update(use_sliding_window=False)
    if arch == "qwen3":
        cfg.update(attention_bias=False)
    return cfg


def _rope_scaling(m: Metadata, tensors: dict, arch: str, head_dim: int, theta: float, source: str) -> dict | None:
    kind = m.str(f"{arch}.rope.scaling.type", "none")
    if kind not in ("none", "llama3"):
        raise GDecodeError(f"{source}: rope scaling {kind!r} is not supported (supported: none, llama3)")
    if "rope_freqs.weight" not in tensors:
        return None
    # Llama 3.x: llama.cpp stores per-frequency divisors instead of the scaling parameters
    _check_type(tensors["rope_freqs.weight"], source)
    factors = _dequant(tensors["rope_freqs.weight"]).reshape(-1).astype(np.float64)
    if factors.shape != (head_dim // 2,) or not np.all(np.isfinite(factors)):
        raise GDecodeError(f"{source}: rope_freqs.weight must hold {head_dim // 2} finite values")
    if np.allclose(factors, 1.0):
        return None
    scaling = {
        "rope_type": "llama3",
        "factor": float(factors.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": m.int(f"{arch}.rope.scaling.original_context_length", 8192),
    }
    expected = _llama3_factors(scaling, head_dim, theta)
    if not np.allclose(factors, expected, rtol=1e-3):
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
    d = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
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
    if cfg["model_type"] == "qwen2" or cfg.get("attention_bias"):
        layer["attn_q.bias"] = ("self_attn.q_proj.bias", (q,))
        layer["attn_k.bias"] = ("self_attn.k_proj.bias", (kv,))
        layer["attn_v.bias"] = ("self_attn.v_proj.bias", (kv,))
    if cfg.get("attention_bias") and cfg["model_type"] == "llama":
        layer["attn_output.bias"] = ("self_attn.o_proj.bias", (h,))
    if cfg["model_type"] == "qwen3":
        layer["attn_q_norm.weight"] = ("self_attn.q_norm.weight", (d,))
        layer["attn_k_norm.weight"] = ("self_attn.k_norm.weight", (d,))
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
    # llama.cpp reorders Q and K rows for llama only (qwen2 and qwen3 use the NeoX rotary layout as stored)
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    heads = {"attn_q.weight": nh, "attn_k.weight": nkv, "attn_q.bias": nh, "attn_k.bias": nkv}
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
