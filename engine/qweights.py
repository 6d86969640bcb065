"""Whole-model operations on weights that may hold quantized matrices: fuse, quantize, dequantize, size."""

from __future__ import annotations

from dataclasses import fields, replace

import ml_dtypes
import numpy as np

from engine.errors import GDecodeError
from engine.quant import QTYPES, QUANTIZE_AT_LOAD, QuantMatrix, QuantStack, dequantize, is_quantized, quantize
from engine.weights import LayerWeights, ModelWeights
from engine.weights import weight_arrays as arrays

BF16 = np.dtype(ml_dtypes.bfloat16)
MATRICES = ("wqkv", "wo", "w_gate_up", "w_down")  # per layer; embed and lm_head besides


def fuse(parts: list):
    """Rows of parts concatenated: a QuantStack when every part is quantized, else one dense array
    (a dense part beside quantized ones makes the whole stack float32, ggml's values exactly)."""
    quantized = [is_quantized(p) for p in parts]
    if all(quantized):
        return QuantStack(tuple(q for p in parts for q in (p.parts if isinstance(p, QuantStack) else (p,))))
    if any(quantized):
        return np.concatenate([dequantize(p) if is_quantized(p) else np.asarray(p, np.float32) for p in parts])
    dtypes = {p.dtype for p in parts}
    return np.concatenate(parts) if len(dtypes) == 1 else np.concatenate([p.astype(np.float32) for p in parts])


def _map(weights: ModelWeights, fn, names: tuple[str, ...] | None = None) -> ModelWeights:
    """weights with fn applied to every array (or only to the named layer fields, embed and lm_head)."""

    def one(name, a):
        return a if a is None or (names is not None and name not in names) else fn(a)

    embed = one("embed", weights.embed)
    lm_head = embed if weights.lm_head is weights.embed else one("lm_head", weights.lm_head)
    layers = [LayerWeights(**{f.name: one(f.name, getattr(lw, f.name)) for f in fields(lw)}) for lw in weights.layers]
    return replace(weights, embed=embed, layers=layers, lm_head=lm_head,
                   final_norm=one("final_norm", weights.final_norm))


def has_quantized(weights: ModelWeights) -> bool:
    return any(is_quantized(a) for a in arrays(weights))


def dequantized(weights: ModelWeights, round_bf16: bool = True) -> ModelWeights:
    """Every tensor dense: quantized matrices dequantized to ggml's float32 values. With round_bf16
    (what import-gguf writes) every tensor, dense ones too, is rounded to bf16 and kept as bf16;
    without it quantized matrices become float32 and dense tensors stay as they are."""

    def dense(a):
        if is_quantized(a):
            a = dequantize(a)
        return np.asarray(a, np.float32).astype(BF16) if round_bf16 else a

    return _map(weights, dense)


def quantize_weights(weights: ModelWeights, qtype: str) -> ModelWeights:
    """Every matrix (QKV, O, gate/up, down, embedding, lm_head) in ggml block format qtype, made from
    its bf16 values (the matrix as the dense upload rounds it); vectors stay as they are."""
    check_quantize(weights, qtype)

    def q(a):
        return quantize(np.asarray(a).astype(BF16).astype(np.float32), qtype)

    return _map(weights, q, (*MATRICES, "embed", "lm_head"))


def check_format(qtype: str) -> None:
    if qtype not in QUANTIZE_AT_LOAD:
        raise GDecodeError(f"--quantize {qtype}: unknown format (choose from {', '.join(QUANTIZE_AT_LOAD)})")


def check_quantize(weights: ModelWeights, qtype: str, source: str = "the model") -> None:
    """GDecodeError unless weights are dense and every matrix can be cut into qtype's blocks."""
    check_format(qtype)
    if has_quantized(weights):
        types = sorted({t for a in arrays(weights) for t in qtypes(a)})
        raise GDecodeError(f"--quantize {qtype}: {source} is already quantized ({', '.join(types)}); "
                           "--quantize applies to bf16, fp16 and fp32 models")
    block = QTYPES[qtype].block
    named = [("embed", weights.embed), ("lm_head", weights.lm_head)]
    named += [(f, getattr(lw, f)) for lw in weights.layers[:1] for f in MATRICES]
    for name, a in named:
        if a.shape[1] % block:
            raise GDecodeError(f"--quantize {qtype}: {name} has {a.shape[1]} columns, not a multiple of {block}")


def qtypes(a) -> list[str]:
    """Storage type names of one weight: q4_k, ... for blocks, the numpy dtype name for dense arrays."""
    if isinstance(a, QuantStack):
        return [p.qtype for p in a.parts]
    if isinstance(a, QuantMatrix):
        return [a.qtype]
    return [str(a.dtype)]


def device_bytes(weights: ModelWeights) -> int:
    """Bytes the weights take on the GPU: block formats as stored, dense matrices in bf16, vectors f32."""
    total = 0
    for a in arrays(weights):
        if is_quantized(a):
            total += a.nbytes
        else:
            total += a.size * (2 if a.ndim == 2 else 4)
    return total


def elements(weights: ModelWeights) -> int:
    """Number of weights (a tied lm_head counted once)."""
    return sum(a.rows * a.cols if is_quantized(a) else a.size for a in arrays(weights))


def stored_bytes(weights: ModelWeights) -> int:
    """Bytes of the weights as held on the host: blocks as stored, dense arrays in their dtype."""
    return sum(a.nbytes for a in arrays(weights))
