"""Model configuration read from a Hugging Face config.json."""

from __future__ import annotations

import json
import math
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
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool  # RMSNorm on q and k per head before RoPE (Qwen3)
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "bfloat16"
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
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise GDecodeError(f"model directory not found: {model_dir}")
        path = model_dir / "config.json"
        if not path.is_file():
            raise GDecodeError(f"no config.json in {model_dir}")
        try:
            d = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise GDecodeError(f"{path}: not valid JSON ({e})") from None
        gen = model_dir / "generation_config.json"
        if gen.is_file():
            try:
                g = json.loads(gen.read_text())
                if g.get("eos_token_id") is not None:
                    d = {**d, "_generation_eos": g["eos_token_id"]}
            except json.JSONDecodeError:
                pass
        return cls.from_dict(d, source=str(path))

    @classmethod
    def from_dict(cls, d: dict, source: str = "config.json") -> ModelConfig:
        archs = d.get("architectures") or []
        arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            names = ", ".join(ARCHITECTURES)
            got = ", ".join(archs) if archs else d.get("model_type", "none given")
            raise GDecodeError(f"{source}: unsupported architecture {got} (supported: {names})")
        if d.get("mlp_bias"):
            raise GDecodeError(f"{source}: mlp_bias is not supported")
        try:
            hidden = int(d["hidden_size"])
            heads = int(d["num_attention_heads"])
            kv_heads = int(d.get("num_key_value_heads") or heads)
            head_dim = int(d.get("head_dim") or hidden // heads)
            theta, scaling = _rope(d, source)
            ctx = int(d.get("max_position_embeddings", 4096))
            window = d.get("sliding_window")
            if window and (arch == "mistral" or d.get("use_sliding_window")):
                ctx = min(ctx, int(window))  # attention past the window would differ: stay inside it
            return cls(
                arch=arch,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_layers=int(d["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                max_position_embeddings=ctx,
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=arch == "qwen2" or bool(d.get("attention_bias", False)),
                qk_norm=arch == "qwen3",
                rope_scaling=scaling,
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=_ids(d.get("_generation_eos", d.get("eos_token_id"))),
                torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "bfloat16"),
            )
        except KeyError as e:
            raise GDecodeError(f"{source}: missing field {e.args[0]}") from None
        except (TypeError, ValueError) as e:
            raise GDecodeError(f"{source}: bad value ({e})") from None

    # sizes used by `info` and the benchmarks
    def param_count(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i + 2 * h
        if self.attention_bias:
            per_layer += self.q_size + 2 * self.kv_size
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


def _ids(x) -> tuple[int, ...]:
    if x is None:
        return ()
    if isinstance(x, (list, tuple)):
        return tuple(int(i) for i in x)
    return (int(x),)


def _rope(d: dict, source: str) -> tuple[float, RopeScaling | None]:
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or params
    theta = float(d.get("rope_theta") or params.get("rope_theta") or 10000.0)
    kind = scaling.get("rope_type") or scaling.get("type") if scaling else None
    if kind in (None, "default"):
        return theta, None
    if kind != "llama3":
        raise GDecodeError(f"{source}: unsupported rope scaling {kind!r} (supported: default, llama3)")
    return theta, RopeScaling(
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )
