"""A model path to config, weights and tokenizer: a Hugging Face folder or a .gguf file."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.config import ModelConfig
from engine.gguf_model import gguf_plan, is_gguf, open_model, tensor_types
from engine.tokenizer import Tokenizer
from engine.weights import ModelWeights, load_weights


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


def load_model(path: str | Path, tokenizer: bool = True) -> LoadedModel:
    """Config, weights and (with tokenizer) the tokenizer of a model folder or GGUF file."""
    if is_gguf(path):
        cfg, weights, tok, plan = open_model(path, tokenizer=tokenizer)
        return LoadedModel(cfg, weights, tok, True, tensor_types(plan))
    cfg = ModelConfig.from_dir(path)
    tok = Tokenizer.from_dir(path, cfg) if tokenizer else None
    return LoadedModel(cfg, load_weights(path, cfg), tok, False)
