"""Quantized weight matrices on the device: upload of ggml blocks (repacked on the GPU), --quantize
at load, random blocks for benchmarks, and llama.cpp's per-tensor type choice for the bench presets."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kernels.gemv_ops import QuantWeight, is_quant, quantize_bf16
from kernels.quant_layout import fmt_of, random_blocks, repack, row_layout

REPACK_BYTES = 1 << 28  # ggml bytes repacked at a time (bounds the temporaries)


@dataclass(frozen=True, eq=False)
class StackedWeight:
    """Rows of several device matrices of different formats (fused QKV whose v is Q6_K beside Q4_K q
    and k; gate/up of two types): parts[i] holds rows offsets[i]..offsets[i + 1]."""

    parts: tuple
    offsets: tuple[int, ...]

    @property
    def rows(self) -> int:
        return self.offsets[-1]

    @property
    def cols(self) -> int:
        p = self.parts[0]
        return p.cols if is_quant(p) else p.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(int(p.nbytes) for p in self.parts)


def repack_on_device(fmt: str, raw, rows: int, cols: int) -> QuantWeight:
    """A QuantWeight from ggml blocks raw [rows, cols // block * block_bytes] (host or device uint8)."""
    import cupy as cp

    lay = row_layout(fmt, cols)
    out = cp.empty((rows, lay.row_bytes), cp.uint8)
    step = max(1, REPACK_BYTES // max(1, raw.shape[1]))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        part = cp.asarray(raw[r0:r1])
        out[r0:r1] = repack(lay.fmt, part, r1 - r0, cols, xp=cp)
    return QuantWeight(lay.fmt.name, rows, cols, out)


def upload_quant(w) -> QuantWeight | StackedWeight:
    """A QuantMatrix or QuantStack (engine/quant.py) on the device; a stack's neighbouring parts of one
    type become one matrix, so a stack of one type is a plain QuantWeight."""
    parts = list(w.parts) if hasattr(w, "parts") else [w]
    runs: list[list] = []
    for p in parts:
        if runs and runs[-1][0].qtype == p.qtype:
            runs[-1].append(p)
        else:
            runs.append([p])
    mats, offsets = [], [0]
    for run in runs:
        raw = run[0].data if len(run) == 1 else np.concatenate([p.data for p in run])
        rows = sum(p.rows for p in run)
        mats.append(repack_on_device(run[0].qtype, raw, rows, run[0].cols))
        offsets.append(offsets[-1] + rows)
    return mats[0] if len(mats) == 1 else StackedWeight(tuple(mats), tuple(offsets))


def quantize_on_device(bf16_bits, fmt: str) -> QuantWeight:
    """--quantize: a bf16 matrix (device uint16 [rows, cols]) in ggml blocks, bit-exact with the gguf
    quantizer on the same bf16 values, then repacked."""
    import cupy as cp

    f = fmt_of(fmt)
    rows, cols = bf16_bits.shape
    raw = cp.empty((rows, cols // f.block * f.block_bytes), cp.uint8)
    quantize_bf16(cp.ascontiguousarray(bf16_bits), raw, f.name)
    return repack_on_device(f.name, raw, rows, cols)


def random_quant(fmt: str, rows: int, cols: int, seed: int) -> QuantWeight:
    """Random blocks made on the device: random bits, finite fp16 scales, weights within about
    +-cols^-0.5 * 2."""
    import cupy as cp

    f = fmt_of(fmt)
    out = cp.empty((rows, row_layout(f, cols).row_bytes), cp.uint8)
    step = max(1, REPACK_BYTES // (cols // f.block * f.block_bytes))
    for i, r0 in enumerate(range(0, rows, step)):
        r1 = min(rows, r0 + step)
        raw = random_blocks(f, r1 - r0, cols, xp=cp, seed=seed * 7919 + i, scale=2 * cols**-0.5)
        out[r0:r1] = repack(f, raw, r1 - r0, cols, xp=cp)
    return QuantWeight(f.name, rows, cols, out)


def is_blocks(w) -> bool:
    """A device matrix in a block format (QuantWeight or StackedWeight)."""
    return is_quant(w) or isinstance(w, StackedWeight)


# --- llama.cpp's type per tensor (llama-quant.cpp) for the bench presets ----------------------------

PRESETS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "q4_k_m", "q5_k_m")
# a row length that is not a multiple of 256 takes this type instead (tensor_type_fallback)
FALLBACK = {"q2_k": "q4_0", "q3_k": "q4_0", "q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's layers that Q4_K_M / Q5_K_M give more bits: the first and last eighth, and every
    third one between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def fits(qtype: str, cols: int) -> str:
    return FALLBACK[qtype] if fmt_of(qtype).block == 256 and cols % 256 else qtype


def preset_type(preset: str, tensor: str, layer: int, layers: int, cols: int) -> str:
    """The ggml type llama-quantize gives `tensor` (output, token_embd, attn_q, attn_k, attn_v,
    attn_output, ffn_gate, ffn_up, ffn_down) in layer `layer` for the preset, after the shape fallback."""
    base = {"q4_k_m": "q4_k", "q5_k_m": "q5_k"}.get(preset, preset)
    t = base
    if tensor == "output":  # also a tied token_embd
        t = "q8_0" if cols % fmt_of(base).block else base if base in ("q8_0", "q6_k") else "q6_k"
    if preset in ("q4_k_m", "q5_k_m") and tensor in ("attn_v", "ffn_down") and use_more_bits(layer, layers):
        t = "q6_k"
    return fits(t, cols)
