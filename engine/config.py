"""Model configuration read from a Hugging Face config.json."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from engine.errors import GDecodeError

# HF architecture name -> our family name
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.x frequency scaling (rope_type "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # llama | mistral | qwen2 | qwen3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2; Llama, Qwen3 with attention_bias)
    qk_norm: bool  # RMSNorm on q and k per head before RoPE (Qwen3)
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "bfloat16"
    o_proj_bias: bool = False  # o_proj carries a bias too (Llama, Qwen3 with attention_bias)
    # derived
    q_size: int = field(init=False)
    kv_size: int = field(init=False)
    group_size: int = field(init=False)

    def __post_init__(self):
        assert self.num_heads % self.num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
        assert self.head_dim % 2 == 0, "head_dim must be even for RoPE"
        object.__setattr__(self, "q_size", self.num_heads * self.head_dim)
        object.__setattr__(self, "kv_size", self.num_kv_heads * self.head_dim)
        object.__setattr__(self, "group_size", self.num_heads // self.num_kv_heads)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        """The config of a Hugging Face model folder: config.json, with EOS ids from generation_config.json."""
        model_dir = Path(model_dir)
        check_model_path(model_dir)
        if not model_dir.is_dir():
            raise GDecodeError(f"{model_dir} is not a model directory")
        path = model_dir / "config.json"
        if not path.is_file():
            raise GDecodeError(f"no config.json in {model_dir}")
        d = _read_json(path)
        gen = model_dir / "generation_config.json"
        if gen.is_file():
            g = _read_json(gen)
            if g.get("eos_token_id") is not None:
                d = {**d, "_generation_eos": list(_Fields(g, str(gen)).ids("eos_token_id"))}
        return cls.from_dict(d, source=str(path))

    @classmethod
    def from_dict(cls, d: dict, source: str = "config.json") -> ModelConfig:
        """Validate a config.json dict: every field by type and range, each problem one GDecodeError line."""
        if not isinstance(d, dict):
            raise GDecodeError(f"{source}: must be a JSON object, not {_kind(d)}")
        f = _Fields(d, source)
        archs = d.get("architectures") or []
        if not isinstance(archs, list):
            archs = [archs]
        arch = next((ARCHITECTURES[a] for a in archs if isinstance(a, str) and a in ARCHITECTURES), None)
        if arch is None:
            names = ", ".join(ARCHITECTURES)
            got = ", ".join(map(str, archs)) if archs else d.get("model_type", "none given")
            raise GDecodeError(f"{source}: unsupported architecture {got} (supported: {names})")
        if f.bool("mlp_bias", False):
            raise GDecodeError(f"{source}: mlp_bias is not supported")
        hidden = f.int("hidden_size")
        heads = f.int("num_attention_heads", hi=hidden)
        # absent: one KV head per head, as transformers' Llama (its Mistral and Qwen classes default to
        # 8 and 32 instead; the checkpoint's k_proj shape then decides, and load_weights names a mismatch)
        kv_heads = f.int("num_key_value_heads", heads, hi=heads)
        if heads % kv_heads:
            raise GDecodeError(f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads "
                               f"{kv_heads}")
        if d.get("head_dim") is None and hidden % heads:
            raise GDecodeError(f"{source}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
        head_dim = f.int("head_dim", hidden // heads)
        if head_dim % 2:
            raise GDecodeError(f"{source}: head_dim {head_dim} must be even for RoPE")
        vocab = f.int("vocab_size")
        theta, scaling = _rope(f)
        ctx = f.int("max_position_embeddings", 4096)
        window = f.int("sliding_window", None)
        if window and (arch == "mistral" or f.bool("use_sliding_window", False)):
            ctx = min(ctx, window)  # attention past the window would differ: stay inside it
        bos = f.int("bos_token_id", None, lo=0, hi=vocab - 1)
        eos_key = "_generation_eos" if "_generation_eos" in d else "eos_token_id"
        dtype = d.get("torch_dtype") or d.get("dtype") or "bfloat16"
        if not isinstance(dtype, str):
            raise GDecodeError(f"{source}: torch_dtype must be a string, not {_kind(dtype)}")
        # Llama and Qwen3 put a bias on q, k, v and o when asked; Qwen2 always on q, k, v; Mistral never
        bias = f.bool("attention_bias", False) and arch in ("llama", "qwen3")
        return cls(
            arch=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=f.int("intermediate_size"),
            num_layers=f.int("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=f.float("rms_norm_eps", 1e-6, hi=1.0),
            rope_theta=theta,
            max_position_embeddings=ctx,
            tie_word_embeddings=f.bool("tie_word_embeddings", False),
            attention_bias=arch == "qwen2" or bias,
            qk_norm=arch == "qwen3",
            rope_scaling=scaling,
            bos_token_id=bos,
            eos_token_ids=tuple(i for i in f.ids(eos_key) if _in_vocab(i, vocab, eos_key, source)),
            torch_dtype=dtype,
            o_proj_bias=bias,
        )

    # sizes used by `info` and the benchmarks
    def param_count(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i + 2 * h
        if self.attention_bias:
            per_layer += self.q_size + 2 * self.kv_size
        if self.o_proj_bias:
            per_layer += h
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_layers * per_layer + h + head

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return 2 * self.num_layers * self.kv_size * dtype_bytes

    def inv_freq(self):
        """RoPE inverse frequencies [head_dim/2] as float64, with llama3 scaling applied."""
        import numpy as np

        hd = self.head_dim
        inv = 1.0 / (self.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
        s = self.rope_scaling
        if s is None:
            return inv
        low_wl = s.original_max_position_embeddings / s.low_freq_factor
        high_wl = s.original_max_position_embeddings / s.high_freq_factor
        wl = 2 * math.pi / inv
        smooth = (s.original_max_position_embeddings / wl - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor
        )
        scaled = np.where(wl > low_wl, inv / s.factor, inv)
        mid = (wl <= low_wl) & (wl >= high_wl)
        return np.where(mid, (1 - smooth) * inv / s.factor + smooth * inv, scaled)


_INT_LIMIT = 1 << 31  # no size or id of a supported model comes near this
_HUB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def check_model_path(path: str | Path) -> None:
    """Raise GDecodeError when path does not exist; a Hugging Face hub name gets its own message."""
    path = Path(path)
    if path.exists():
        return
    if _HUB_NAME.match(str(path)):
        raise GDecodeError(
            f"{path} is not a local path, and downloading from the Hugging Face hub is not supported: pass a "
            f"local model folder (for example from `hf download {path} --local-dir DIR`) or a .gguf file"
        )
    raise GDecodeError(f"model directory not found: {path}")


def _read_json(path: Path):
    try:
        d = json.loads(path.read_bytes())
    except OSError as e:
        raise GDecodeError(f"{path}: cannot read ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise GDecodeError(f"{path}: not valid JSON ({e})") from None
    except RecursionError:
        raise GDecodeError(f"{path}: not valid JSON (nested too deeply)") from None
    if not isinstance(d, dict):
        raise GDecodeError(f"{path}: must be a JSON object, not {_kind(d)}")
    return d


def _kind(v) -> str:
    names = {bool: "a boolean", str: "a string", list: "a list", dict: "an object", float: "a number",
             int: "an integer", type(None): "null"}
    return names.get(type(v), type(v).__name__)


def _in_vocab(i: int, vocab: int, key: str, source: str) -> bool:
    if not 0 <= i < vocab:
        what = "eos_token_id of generation_config.json" if key == "_generation_eos" else key
        raise GDecodeError(f"{source}: {what} {i} is outside the vocabulary [0, {vocab})")
    return True


_REQUIRED = object()


class _Fields:
    """Typed reads of a JSON object: a missing required field, a wrong type or a value out of range is
    one GDecodeError naming the field. A null field counts as absent and takes the default."""

    def __init__(self, d: dict, source: str):
        self.d, self.source = d, source

    def _get(self, key: str, default):
        v = self.d.get(key)
        if v is None and default is _REQUIRED:
            raise GDecodeError(f"{self.source}: missing field {key}")
        return v

    def _bad(self, key: str, want: str, v):
        raise GDecodeError(f"{self.source}: {key} must be {want}, not {_kind(v)} ({v!r:.40})")

    def int(self, key: str, default=_REQUIRED, lo: int = 1, hi: int = _INT_LIMIT):
        v = self._get(key, default)
        if v is None:
            return default
        if type(v) is not int:
            self._bad(key, "an integer", v)
        if not lo <= v <= hi:
            raise GDecodeError(f"{self.source}: {key} is {v}, outside [{lo}, {hi}]")
        return v

    def float(self, key: str, default=_REQUIRED, lo: float = 0.0, hi: float = math.inf):
        v = self._get(key, default)
        if v is None:
            return default
        if type(v) not in (int, float):
            self._bad(key, "a number", v)
        if not (math.isfinite(v) and lo < v < hi):
            raise GDecodeError(f"{self.source}: {key} is {v}, outside ({lo:g}, {hi:g})")
        return float(v)

    def bool(self, key: str, default: bool) -> bool:
        v = self._get(key, default)
        if v is None:
            return default
        if type(v) is not bool:
            self._bad(key, "true or false", v)
        return v

    def ids(self, key: str) -> tuple[int, ...]:
        v = self.d.get(key)
        if v is None:
            return ()
        items = v if isinstance(v, list) else [v]
        if not all(type(i) is int and i >= 0 for i in items):
            self._bad(key.lstrip("_"), "a token id or a list of ids", v)
        return tuple(items)


def _rope(f: _Fields) -> tuple[float, RopeScaling | None]:
    d, source = f.d, f.source
    params = d.get("rope_parameters")
    scaling = d.get("rope_scaling")
    for key, v in (("rope_parameters", params), ("rope_scaling", scaling)):
        if v is not None and not isinstance(v, dict):
            raise GDecodeError(f"{source}: {key} must be an object or null, not {_kind(v)}")
    params = params or {}
    scaling = scaling or params
    theta = f.float("rope_theta", None)
    if theta is None:
        theta = _Fields(params, source + " rope_parameters").float("rope_theta", 10000.0)
    if not scaling:
        return theta, None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return theta, None
    if kind != "llama3":
        raise GDecodeError(f"{source}: unsupported rope scaling {kind!r} (supported: default, llama3)")
    s = _Fields(scaling, f"{source} rope_scaling")
    low, high = s.float("low_freq_factor", _REQUIRED), s.float("high_freq_factor", _REQUIRED)
    if high <= low:
        raise GDecodeError(f"{source} rope_scaling: high_freq_factor {high} must exceed low_freq_factor {low}")
    return theta, RopeScaling(
        factor=s.float("factor", _REQUIRED),
        low_freq_factor=low,
        high_freq_factor=high,
        original_max_position_embeddings=s.int("original_max_position_embeddings"),
    )
