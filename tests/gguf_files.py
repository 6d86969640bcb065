"""Tiny GGUF files written from tiny Hugging Face checkpoints, as llama.cpp's converter lays them out.

Formats the gguf package can quantize are made with it; q4_k and q6_k with the small encoders
below (valid blocks close to the weights, not llama.cpp's search); q2_k, q3_k and q5_k as random
valid blocks. Each tensor's type comes from a mix: a dict of GGUF tensor name -> type name.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as GT
from gguf import GGUFWriter
from gguf.quants import quantize as gguf_quantize
from safetensors.numpy import load_file

from engine.quant import QTYPES

_NAMES = {
    "attn_norm": "input_layernorm.weight", "attn_q": "self_attn.q_proj.weight",
    "attn_k": "self_attn.k_proj.weight", "attn_v": "self_attn.v_proj.weight",
    "attn_output": "self_attn.o_proj.weight", "ffn_norm": "post_attention_layernorm.weight",
    "ffn_gate": "mlp.gate_proj.weight", "ffn_up": "mlp.up_proj.weight", "ffn_down": "mlp.down_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
}


def q4_k_m_mix(layers: int) -> dict[str, str]:
    """llama.cpp's Q4_K_M choice: Q4_K, with attn_v and ffn_down in Q6_K on its 'more bits' layers
    (the first and last eighth and every third layer), the output in Q6_K."""
    mix = {"token_embd": "q4_k", "output": "q6_k"}
    for i in range(layers):
        more = i < layers / 8 or i >= 7 * layers / 8 or (i - layers // 8) % 3 == 2
        for t in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            mix[f"blk.{i}.{t}"] = "q4_k"
        for t in ("attn_v", "ffn_down"):
            mix[f"blk.{i}.{t}"] = "q6_k" if more else "q4_k"
    return mix


def every_format_mix(layers: int) -> dict[str, str]:
    """Every supported tensor type at least once, several per fused stack."""
    kinds = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "f16", "bf16", "f32"]
    mix, n = {"token_embd": "q5_k", "output": "q3_k"}, 0
    for i in range(layers):
        for t in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
            mix[f"blk.{i}.{t}"] = kinds[n % len(kinds)]
            n += 1
    return mix


def _fp16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(*x.shape[:-1], -1)


def _q6_k(w: np.ndarray) -> np.ndarray:
    x = w.reshape(-1, 16, 16)  # blocks, groups of 16
    s = np.abs(x).max(axis=2) / 31
    d = (s.max(axis=1, keepdims=True) / 127).astype(np.float16)
    sc = np.where(d > 0, np.rint(s / np.maximum(d.astype(np.float32), 1e-30)), 0).clip(0, 127)
    eff = (d.astype(np.float32) * sc)[..., None]
    q = (np.where(eff > 0, np.rint(x / np.where(eff > 0, eff, 1)), 0).clip(-32, 31) + 32).astype(np.uint8)
    q = q.reshape(-1, 2, 4, 32)  # half, quarter, lane
    ql = (q[:, :, [0, 1]] & 15) | ((q[:, :, [2, 3]] & 15) << 4)  # byte 32 k + l: quarters k and k + 2
    qh = ((q >> 4) << np.array([0, 2, 4, 6], np.uint8)[:, None]).sum(axis=2, dtype=np.uint8)
    n = x.shape[0]
    return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.astype(np.int8).view(np.uint8),
                           _fp16(d)], axis=1)


def _q4_k(w: np.ndarray) -> np.ndarray:
    x = w.reshape(-1, 8, 32)
    lo = np.minimum(x.min(axis=2), 0)
    s = (x.max(axis=2) - lo) / 15
    d = (s.max(axis=1, keepdims=True) / 63).astype(np.float16)
    dmin = (np.abs(lo).max(axis=1, keepdims=True) / 63).astype(np.float16)
    df, mf = d.astype(np.float32), dmin.astype(np.float32)
    sc = np.where(df > 0, np.rint(s / np.where(df > 0, df, 1)), 0).clip(0, 63).astype(np.uint8)
    mc = np.where(mf > 0, np.rint(-lo / np.where(mf > 0, mf, 1)), 0).clip(0, 63).astype(np.uint8)
    step, off = (df * sc)[..., None], (mf * mc)[..., None]
    q = np.where(step > 0, np.rint((x + off) / np.where(step > 0, step, 1)), 0).clip(0, 15).astype(np.uint8)
    scales = np.concatenate([
        (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6),
        (mc[:, :4] & 63) | ((mc[:, 4:] >> 4) << 6),
        (sc[:, 4:] & 15) | ((mc[:, 4:] & 15) << 4),
    ], axis=1)
    q = q.reshape(-1, 4, 2, 32)  # run of 32 bytes holds groups 2c (low nibbles) and 2c + 1 (high)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([_fp16(d), _fp16(dmin), scales, qs], axis=1)


def _random_blocks(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    from tests.test_quant import random_blocks

    return random_blocks(qtype, rows, cols, rng).data


def encode(w: np.ndarray, kind: str, rng: np.random.Generator) -> tuple[np.ndarray, GT | None]:
    """(data, raw_dtype) for GGUFWriter.add_tensor of float32 w [rows, cols] stored as kind."""
    rows, cols = w.shape
    if kind == "f32":
        return w, None
    if kind == "f16":
        return w.astype(np.float16), None
    if kind == "bf16":
        return gguf_quantize(w, GT.BF16), GT.BF16
    q = QTYPES[kind]
    if kind == "q4_k":
        data = _q4_k(w)
    elif kind == "q6_k":
        data = _q6_k(w)
    elif kind in ("q2_k", "q3_k", "q5_k"):
        data = _random_blocks(kind, rows, cols, rng)
    else:
        data = gguf_quantize(w, q.ggml)
    return np.ascontiguousarray(data.reshape(rows, -1)), q.ggml


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py's LlamaModel.permute: each head's two rotary halves interleaved row by row
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model_dir: str | Path, path: str | Path, mix: dict[str, str] | None = None, seed: int = 0) -> Path:
    """A GGUF of the tiny llama/qwen2 checkpoint in model_dir (float32 safetensors), tensors typed by mix
    (GGUF name without .weight -> type; missing names are f32)."""
    model_dir, path = Path(model_dir), Path(path)
    cfg = json.loads((model_dir / "config.json").read_text())
    arch = cfg["model_type"]
    tensors = load_file(str(model_dir / "model.safetensors"))
    rng = np.random.default_rng(seed)
    mix = mix or {}
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_rope_freq_base(float(cfg["rope_parameters"]["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    _add_tokenizer(w, model_dir)
    names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    if not cfg["tie_word_embeddings"]:
        names["output.weight"] = "lm_head.weight"
    for i in range(cfg["num_hidden_layers"]):
        for g, h in _NAMES.items():
            if f"model.layers.{i}.{h}" in tensors:
                names[f"blk.{i}.{g}" + ("" if g.endswith(".bias") else ".weight")] = f"model.layers.{i}.{h}"
    for gname, hname in names.items():
        x = tensors[hname].astype(np.float32)
        if arch == "llama" and gname.split(".")[-2] in ("attn_q", "attn_k"):
            x = llama_cpp_permute(x, heads if "attn_q" in gname else kv_heads)
        if x.ndim == 1:
            w.add_tensor(gname, x)
            continue
        data, raw = encode(x, mix.get(gname.removesuffix(".weight"), "f32"), rng)
        w.add_tensor(gname, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _add_tokenizer(w: GGUFWriter, model_dir: Path) -> None:
    tj = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in tj.get("added_tokens", []) if t.get("special")}
    tc = json.loads((model_dir / "tokenizer_config.json").read_text())
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]])
    w.add_bos_token_id(vocab[tc["bos_token"]])
    w.add_eos_token_id(vocab[tc["eos_token"]])
    w.add_add_bos_token(bool(tc.get("add_bos_token")))
    w.add_chat_template(tc["chat_template"])
