"""The kernel builds that the decode step makes on an H200 (132 SMs): its GEMVs, attention, sampler and
embedding, as `// defines:` lines for their kernel files, marked NEW where the file does not declare them yet.
Needs no GPU.

PYTHONPATH=. python3 dev/step_builds.py [--sms N] [--quant FORMAT [--head FORMAT]] [shape ...]

Default: every bench shape in bf16, and the default model's shape as its GGUF stores it (Q4_1 layers, a Q8_0
lm_head). --quant: the shapes with every matrix in FORMAT and the lm_head in --head (one format per matrix: the
mixes of `gdecode bench --quant`'s presets, such as Q4_K_M's Q6_K rows, are not modelled).
CI compiles every declared build (tests/test_compiler.py: registers within budget, no stack, no spills), so the
builds the step really runs belong among them. The launch builders of kernels/ are called as graphs/decode.py
calls them, each build compiled for sm_90 in place of loading it (a block format's fallback to fewer loads or
rows where a build spills is taken as on a device). The argument values are stand-ins: only the builds count.
"""

from __future__ import annotations

import sys

import numpy as np

import kernels.attention as A
import kernels.gemv_ops as G
import kernels.ops as O
from engine.shapes import SHAPES, shape
from kernels.compiler import compile_kernel, declared_defines
from kernels.quant_layout import fmt_of

ORDER = ("K", "EPILOGUE", "NORM", "BIAS", "ARGMAX", "ROWS", "HEAD_DIM", "UNROLL", "SPLIT_K", "WARPS", "MIN_BLOCKS")
DEFAULT_MODEL = ("smollm2-135m", "q4_1", "q8_0")
# what gemv.cu's declared lines may leave out: the kernels' own defaults
DEFAULTS = {"NORM": "0", "BIAS": "0", "ARGMAX": "0", "SPLIT_K": "1", "WARPS": "8", "MIN_BLOCKS": "2", "X_SMEM": "0"}


class Recorder:
    """Stands in for kernels.ops.module: compiles each build for sm_90 (raising where it spills, as loading
    would) and records (source, defines) instead of loading it."""

    def __init__(self):
        self.builds: list[tuple[str, dict[str, str]]] = []

    def __call__(self, source: str, **defines):
        compile_kernel(source, defines, arch="sm_90")
        self.builds.append((source, {k: str(v) for k, v in defines.items()}))
        return self

    def function(self, name, sig=None):
        return self

    def prepare(self, *args, **kwargs):
        return None


def canonical(d: dict[str, str]) -> tuple:
    """The defines without the GEMV kernels' defaults (the other kernels' lines name every define)."""
    if "EPILOGUE" in d:
        d = {k: v for k, v in d.items() if DEFAULTS.get(k) != v}
        if d.get("ROWS") == ("2" if d["EPILOGUE"] in ("EPI_SILU", "EPI_ROPE") else "1"):
            del d["ROWS"]
    return tuple(sorted(d.items()))


def matrix(fmt: str | None, rows: int, cols: int):
    """A stand-in weight: bf16 (numpy) or a QuantWeight of that format (no data)."""
    if fmt is None:
        return np.zeros(1, np.uint16)
    return G.QuantWeight(fmt_of(fmt).name, rows, cols, None)


def step_builds(name: str, fmt: str | None = None, head: str | None = None) -> list[tuple[str, dict[str, str]]]:
    cfg = shape(name)
    one, amax = object(), object()
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    rec = Recorder()
    G.module = A.module = O.module = rec
    if fmt is None:
        O.embed(None, None, None, cfg.vocab_size, h)
    else:
        G.embed_quant(matrix(head, cfg.vocab_size, h), None, None)
    w = matrix(fmt, q + 2 * kv, h)
    if cfg.qk_norm:
        G.gemv(w, None, None, cfg.q_size + 2 * cfg.kv_size, h, gamma=one, bias=one if cfg.attention_bias else None)
    else:
        G.gemv_rope(w, None, one, one if cfg.attention_bias else None, None, None, None, None, None, None,
                    nh=cfg.num_heads, nkv=cfg.num_kv_heads, hd=cfg.head_dim, k=h, max_ctx=2, eps=1e-5)
    A.attn_decode(None, None, None, None, None, None, None, None, None, nh=cfg.num_heads, kv_heads=cfg.num_kv_heads,
                  hd=cfg.head_dim, splits=1, max_ctx=2)
    G.gemv(matrix(fmt, h, q), None, None, h, q, bias=one if cfg.o_proj_bias else None, epi=G.EPI_ADD,
           whole=G.GemvTuning().o_whole)
    G.gemv(matrix(fmt, 2 * inter, h), None, None, inter, h, gamma=one, epi=G.EPI_SILU)
    G.gemv(matrix(fmt, h, inter), None, None, h, inter, epi=G.EPI_ADD)
    G.gemv(matrix(head, cfg.vocab_size, h), None, None, cfg.vocab_size, h, gamma=one, amax=amax, pair=True)
    O.sample(None, None, None, None, None, None, None, None, None, vocab=cfg.vocab_size, max_ctx=2)
    return rec.builds


def main(argv):
    opts = {a: argv[i + 1] for i, a in enumerate(argv) if a in ("--sms", "--quant", "--head")}
    sms = int(opts.get("--sms", 132))
    G.sm_count = O.sm_count = lambda: sms
    names = [a for a in argv if not a.startswith("--") and a not in opts.values()] or list(SHAPES)
    if "--quant" in opts:
        runs = [(n, opts["--quant"], opts.get("--head", opts["--quant"])) for n in names]
    else:
        runs = [(n, None, None) for n in names] + [DEFAULT_MODEL]
    seen: dict[str, dict[tuple, list[str]]] = {}
    for name, fmt, head in runs:
        for source, d in step_builds(name, fmt, head):
            label = name if fmt is None else f"{name} {fmt}/{head}"
            seen.setdefault(source, {}).setdefault(canonical(d), []).append(label)
    for source, builds in seen.items():
        declared = {canonical(d) for d in declared_defines(source)}
        print(f"kernels/{source}.cu")
        for key, labels in builds.items():
            d = dict(key)
            line = " ".join(f"{k}={d[k]}" for k in [*ORDER, *sorted(set(d) - set(ORDER))] if k in d)
            print(f"// defines: {line:<96} {'' if key in declared else 'NEW '}({', '.join(dict.fromkeys(labels))})")


if __name__ == "__main__":
    main(sys.argv[1:])
