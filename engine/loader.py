"""A model path to config, weights and tokenizer: a Hugging Face folder or a .gguf file."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.config import ModelConfig
from engine.gguf_model import gguf_plan, is_gguf, open_model, tensor_types
from engine.tokenizer import Tokenizer
from engine.weights import ModelWeights, load_weights

DENSE_NAMES = ("F32", "F16", "BF16")


@dataclass
class LoadedModel:
    cfg: ModelConfig
    weights: ModelWeights
    tokenizer: Tokenizer | None
    gguf: bool  # weights came from a GGUF file (quantized matrices stay QuantMatrix / QuantStack)
    tensor_types: dict[str, tuple[int, int]] | None = None  # GGUF: type name -> (tensors, bytes)


def load_config(path: str | Path) -> ModelConfig:
    """The model's config alone (no weights read)."""
    if is_gguf(path):
        _, cfg, _ = gguf_plan(path)
        return ModelConfig.from_dict(cfg, source=str(path))
    return ModelConfig.from_dir(path)


def stored_quantization(path: str | Path) -> str | None:
    """How the checkpoint at path is already quantized (GGUF block types, or a Hugging Face
    quantization_config's method), or None for a dense model. Reads no weights."""
    if is_gguf(path):
        _, _, plan = gguf_plan(path)
        kinds = sorted({e.tensor.tensor_type.name for e in plan if e.tensor.tensor_type.name not in DENSE_NAMES})
        return ", ".join(kinds) or None
    try:
        q = json.loads((Path(path) / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return None  # loading reports it
    return str(q.get("quant_method", "quantized")) if isinstance(q, dict) else None


def load_model(path: str | Path, tokenizer: bool = True) -> LoadedModel:
    """Config, weights and (with tokenizer) the tokenizer of a model folder or GGUF file."""
    if is_gguf(path):
        cfg, weights, tok, plan = open_model(path, tokenizer=tokenizer)
        return LoadedModel(cfg, weights, tok, True, tensor_types(plan))
    cfg = ModelConfig.from_dir(path)
    tok = Tokenizer.from_dir(path, cfg) if tokenizer else None
    return LoadedModel(cfg, load_weights(path, cfg), tok, False)
