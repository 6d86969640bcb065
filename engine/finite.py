"""Scan a model's weights for NaN and Inf (`gdecode info --check`)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from engine.quant import dequantize, is_quantized
from engine.weights import ModelWeights

_CHUNK = 1 << 22  # elements per scan step: bounded memory on large tensors


def named_tensors(weights: ModelWeights) -> Iterator[tuple[str, object]]:
    """(name, array or quantized matrix) of every weight, a tied lm_head once."""
    yield "embed", weights.embed
    if weights.lm_head is not weights.embed:
        yield "lm_head", weights.lm_head
    yield "final_norm", weights.final_norm
    for i, layer in enumerate(weights.layers):
        for field, a in vars(layer).items():
            if a is not None:
                yield f"layers.{i}.{field}", a


def count_nonfinite(a) -> int:
    """How many values of a (a numpy array in any float dtype, or a quantized matrix) are NaN or Inf."""
    flat = (dequantize(a) if is_quantized(a) else np.asarray(a)).reshape(-1)
    return sum(int(np.count_nonzero(~np.isfinite(flat[i : i + _CHUNK].astype(np.float32))))
               for i in range(0, flat.size, _CHUNK))


def first_nonfinite(weights: ModelWeights) -> tuple[str, int] | None:
    """(tensor name, count) of the first weight holding NaN or Inf, or None when every value is finite."""
    for name, a in named_tensors(weights):
        n = count_nonfinite(a)
        if n:
            return name, n
    return None
