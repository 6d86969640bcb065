"""float32 to ggml blocks (placeholder: the gguf package's quantizer)."""

from __future__ import annotations

import numpy as np
from gguf.quants import quantize as _gguf_quantize

from engine.quant import QTYPES


def quantize_blocks(a: np.ndarray, qtype: str) -> np.ndarray:
    """uint8 blocks [rows, cols // block * type_size] of a float [rows, cols] array."""
    return np.ascontiguousarray(_gguf_quantize(np.asarray(a, dtype=np.float32), QTYPES[qtype].ggml))
