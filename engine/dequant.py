"""ggml block formats to float32 (placeholder: the gguf package's dequantizer)."""

from __future__ import annotations

import numpy as np
from gguf.quants import dequantize as _gguf_dequantize

from engine.quant import QTYPES


def dequantize_blocks(data: np.ndarray, qtype: str) -> np.ndarray:
    """float32 [rows, cols] of uint8 blocks [rows, nbytes_per_row]."""
    return np.asarray(_gguf_dequantize(np.asarray(data), QTYPES[qtype].ggml), dtype=np.float32)
