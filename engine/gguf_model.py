"""A GGUF file as a model: config and tokenizer from its metadata, weights memory-mapped and kept quantized."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer as HFTokenizer

from engine.config import ModelConfig
from engine.gguf_import import Entry, build_config, plan_tensors, unpermute
from engine.gguf_mmap import GGUFFile, read_gguf
from engine.gguf_tokenizer import build_tokenizer, check_tokenizer, tokenizer_config
from engine.quant import BY_GGML, DENSE, QuantMatrix, dequantize, permute_rows
from engine.qweights import dequantized, fuse
from engine.tokenizer import Tokenizer
from engine.weights import LayerWeights, ModelWeights

__all__ = ["is_gguf", "load_gguf", "open_model", "gguf_plan", "dequantized", "tensor_types"]


def is_gguf(path: str | Path) -> bool:
    """True for a file (not a directory) whose name ends in .gguf or whose first bytes are GGUF's magic."""
    path = Path(path)
    if path.suffix.lower() == ".gguf":
        return not path.is_dir()
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def gguf_plan(path: str | Path) -> tuple[GGUFFile, dict, list[Entry]]:
    """The parsed file, its config.json dict and the validated tensor plan; raises GDecodeError on any
    problem (missing, truncated, unsupported architecture, tokenizer or tensor type, wrong shape)
    before a single weight is read."""
    f = read_gguf(path)
    source = str(path)
    cfg = build_config(f.meta, f.tensors, source)
    plan = plan_tensors(cfg, f.tensors, source)
    check_tokenizer(f.meta, source)
    return f, cfg, plan


def _tokenizer(meta: dict, cfg: dict, model: ModelConfig, source: str) -> Tokenizer:
    # the same tokenizer.json text that import-gguf writes, loaded the same way
    tok = HFTokenizer.from_str(build_tokenizer(meta, source).to_str())
    config = tokenizer_config(meta, cfg["max_position_embeddings"])
    eos = set(model.eos_token_ids)
    t = Tokenizer(tok, config, config.get("chat_template"), eos, source)
    if t.bos_id is None and model.bos_token_id is not None:
        t.bos_id = model.bos_token_id
    return t


def _tensor(e: Entry):
    """A dense tensor as a read-only view (a copy when its rows are reordered) or a QuantMatrix."""
    t = e.tensor
    dense = DENSE.get(t.tensor_type)
    if dense is not None:
        a = np.asarray(t.data).view(dense).reshape(e.shape)
        return unpermute(a, e.unpermute_heads) if e.unpermute_heads else a
    q = BY_GGML[t.tensor_type]
    if len(e.shape) != 2:  # a quantized vector: norms and biases are read as float32
        return dequantize(QuantMatrix(q.name, 1, e.shape[0], np.asarray(t.data).reshape(1, -1))).reshape(e.shape)
    rows, cols = e.shape
    qm = QuantMatrix(q.name, rows, cols, np.asarray(t.data).reshape(rows, -1))
    if e.unpermute_heads:
        qm = permute_rows(qm, unpermute(np.arange(rows), e.unpermute_heads))
    return qm


def _weights(cfg: ModelConfig, plan: list[Entry]) -> ModelWeights:
    t = {e.name: _tensor(e) for e in plan}
    embed = t["model.embed_tokens.weight"]
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        layers.append(LayerWeights(
            attn_norm=t[p + "input_layernorm.weight"],
            wqkv=fuse([t[a + "q_proj.weight"], t[a + "k_proj.weight"], t[a + "v_proj.weight"]]),
            bqkv=fuse([t[a + "q_proj.bias"], t[a + "k_proj.bias"], t[a + "v_proj.bias"]])
            if cfg.attention_bias else None,
            wo=t[a + "o_proj.weight"],
            q_norm=t.get(a + "q_norm.weight"),
            k_norm=t.get(a + "k_norm.weight"),
            mlp_norm=t[p + "post_attention_layernorm.weight"],
            w_gate_up=fuse([t[m + "gate_proj.weight"], t[m + "up_proj.weight"]]),
            w_down=t[m + "down_proj.weight"],
            bo=t.get(a + "o_proj.bias"),
        ))
    return ModelWeights(embed=embed, layers=layers, final_norm=t["model.norm.weight"],
                        lm_head=t.get("lm_head.weight", embed))


def load_gguf(path: str | Path, tokenizer: bool = True) -> tuple[ModelConfig, ModelWeights, Tokenizer | None]:
    """Config, weights and tokenizer of a llama or qwen2 GGUF file.

    Matrices stored in a block format stay as QuantMatrix (QKV and gate/up as QuantStack) whose
    data are read-only views into the memory-mapped file; dense tensors are numpy views in the
    file's dtype. Q/K rows are put back in Hugging Face order (llama.cpp reorders them for llama).
    Every check runs before any weight is read; problems raise GDecodeError.
    """
    cfg, weights, tok, _ = open_model(path, tokenizer)
    return cfg, weights, tok


def open_model(path: str | Path, tokenizer: bool = True):
    """load_gguf's three results and the tensor plan (for tensor_types)."""
    path = Path(path)
    f, cfg_dict, plan = gguf_plan(path)
    cfg = ModelConfig.from_dict(cfg_dict, source=str(path))
    tok = _tokenizer(f.meta, cfg_dict, cfg, str(path)) if tokenizer else None
    return cfg, _weights(cfg, plan), tok, plan


def tensor_types(plan: list[Entry]) -> dict[str, tuple[int, int]]:
    """Tensor type name (Q4_K, F32, ...) -> (tensor count, bytes) over the tensors the model reads,
    largest first."""
    count, size = Counter(), Counter()
    for e in plan:
        name = e.tensor.tensor_type.name
        count[name] += 1
        size[name] += int(e.tensor.n_bytes)
    return {k: (count[k], size[k]) for k in sorted(count, key=lambda k: -size[k])}
