"""GPU: gate_up hands its outputs to down as int8 x (kernels/gemv_epilogue.cuh XQ_OUT, gemv_core.cuh XQ_IN),
and the RMSNorm's gamma copied into shared memory before the PDL wait (GAMMA_EARLY).

The handed-off bytes must be exactly what down's own staging would make of gate_up's fp32 outputs, so a
step with the hand-off gives the same logits, bit for bit, as one without it."""

from __future__ import annotations

import math

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT
from gguf.quants import dequantize as gguf_dequantize

from kernels import quant_layout as L
from kernels.gemv_ops import EPI_ADD, EPI_SILU
from kernels.tuning import GemvTuning, Tuning
from tests.gemv_check import rel

pytestmark = pytest.mark.gpu
POISON = 0xA5


@pytest.fixture(scope="module")
def cp():
    import cupy

    from kernels.cuda import init

    init()
    return cupy


def quant(fmt: str, rows: int, k: int, seed: int):
    from graphs.quant_weights import repack_on_device

    raw = L.random_blocks(fmt, rows, k, seed=seed, scale=2 / math.sqrt(k))
    return repack_on_device(fmt, raw, rows, k), gguf_dequantize(raw, GT[fmt.upper()]).reshape(rows, k)


def expected_xq(y: np.ndarray, granules: int) -> np.ndarray:
    """The bytes of y as the next GEMV's int8 x: quants with granule g of 16 at (g % G) chunks + g // G,
    then per block of 32 (d, sum of the first 16 quants | sum of the last 16 << 16)."""
    from kernels.gemv_ops import quantize_x

    q, d = quantize_x(y)
    n = len(y)
    g = np.arange(n // 16)
    pos = (g % granules) * (n // (16 * granules)) + g // granules
    planes = np.empty((n // 16, 16), np.int8)
    planes[pos] = q.reshape(-1, 16)
    sums = q.reshape(-1, 2, 16).astype(np.int64).sum(axis=2)
    meta = np.empty((n // 32, 2), np.uint32)
    meta[:, 0] = d.view(np.uint32)
    meta[:, 1] = (sums[:, 0] & 0xFFFF) | ((sums[:, 1] & 0xFFFF) << 16)
    return np.concatenate([planes.view(np.uint8).ravel(), meta.view(np.uint8).ravel()])


# producer format, consumer format, producer row length, outputs, grid cap (a few blocks: many passes each)
CASES = [
    ("q8_0", "q8_0", 4096, 768, None),
    ("q8_0", "q8_0", 4096, 1024, 3),
    ("q4_k", "q6_k", 2048, 768, 5),
    ("q5_0", "q2_k", 1536, 1280, None),
    ("q8_0", "q4_k", 512, 768, None),  # rows of at most 1,024 weights: 8-warp blocks, 8 rows per warp
    ("q4_0", "q8_0", 896, 1536, 2),
]


@pytest.mark.parametrize("prod,cons,k,n,blocks", CASES)
def test_gate_up_hands_down_exactly_its_own_int8_x(cp, prod, cons, k, n, blocks):
    from kernels.gemv_ops import gemv, xq_bytes
    from tests.gemv_check import silu

    rng = np.random.default_rng(k + n)
    granules = L.FORMATS[cons].chunk // 16
    w, wf = quant(prod, 2 * n, k, seed=n)
    x = (rng.standard_normal(k) * 0.05).astype(np.float32)
    g = (0.5 + rng.random(k)).astype(np.float32)
    b = rng.standard_normal(2 * n).astype(np.float32)
    dx, dg, db = cp.asarray(x), cp.asarray(g), cp.asarray(b)
    y = cp.full(n, np.nan, cp.float32)
    xq = cp.full(xq_bytes(n), POISON, cp.uint8)
    up = gemv(w, dx, y, n, k, gamma=dg, bias=db, epi=EPI_SILU, eps=1e-5, blocks=blocks, xq_out=(xq, granules))
    assert up.xq_out, "this launch shape hands off"
    up(cp.cuda.get_current_stream())
    got_y = cp.asnumpy(y)
    # the fp32 outputs as without the hand-off (int8 x of x times gamma, 1/rms after)
    from kernels.gemv_ops import dequantize_x, quantize_x

    xin = dequantize_x(*quantize_x(x * g)) / np.sqrt(np.mean(x.astype(np.float64) ** 2) + 1e-5)
    full = wf.astype(np.float64) @ xin + b
    assert rel(got_y, silu(full[:n]) * full[n:]) < 1e-5
    assert np.array_equal(cp.asnumpy(xq), expected_xq(got_y, granules))

    # down: from the handed-off bytes, or staging y itself; the same bits
    n_down = 300
    wd, _ = quant(cons, n_down, n, seed=7)
    bd = cp.asarray(rng.standard_normal(n_down).astype(np.float32))
    y0 = rng.standard_normal(n_down).astype(np.float32)
    outs = []
    for handed in (True, False):
        out = cp.asarray(y0)
        gemv(wd, xq if handed else y, out, n_down, n, bias=bd, epi=EPI_ADD, xq_in=handed)(
            cp.cuda.get_current_stream())
        outs.append(cp.asnumpy(out))
    assert np.isfinite(outs[0]).all() and not np.array_equal(outs[0], y0)
    assert np.array_equal(outs[0], outs[1])


def test_no_hand_off_where_a_pass_does_not_hold_whole_blocks(cp):
    """Outputs not a multiple of 32 granules of the consumer's chunks: y alone, nothing written to xq."""
    from kernels.gemv_ops import gemv, xq_bytes

    n, k = 336, 1024  # 336 outputs: 10.5 blocks of 32
    w, _ = quant("q8_0", 2 * n, k, seed=1)
    xq = cp.full(xq_bytes(n), POISON, cp.uint8)
    y = cp.full(n, np.nan, cp.float32)
    launch = gemv(w, cp.ones(k, cp.float32), y, n, k, gamma=cp.ones(k, cp.float32), epi=EPI_SILU, eps=1e-5,
                  xq_out=(xq, 1))
    assert not launch.xq_out
    launch(cp.cuda.get_current_stream())
    cp.cuda.get_current_stream().synchronize()
    assert np.isfinite(cp.asnumpy(y)).all()
    assert (cp.asnumpy(xq) == POISON).all()


def _cfg(hidden: int, ffn: int):
    from engine.config import ModelConfig

    return ModelConfig(arch="llama", vocab_size=1000, hidden_size=hidden, intermediate_size=ffn, num_layers=3,
                       num_heads=hidden // 128, num_kv_heads=2, head_dim=128, rms_norm_eps=1e-5,
                       rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=False,
                       attention_bias=False, qk_norm=False)


def _logits(cfg, quant_mix: str, tuning: Tuning, use_graph: bool = True, steps: int = 40):
    from engine.backend_cuda import CudaBackend

    be = CudaBackend(cfg, None, max_context=128, tuning=tuning, use_graph=use_graph, seed=11,
                     random_quant=quant_mix)
    handed = sum(bool(getattr(launch, "xq_out", False)) for launch in be.step.launches)
    be.start([3, 14, 15, 92, 65])
    out = []
    for _ in range(steps):
        be.replay()
        out.append(be.step_logits())
    return np.stack(out), handed


@pytest.mark.parametrize("hidden,ffn", [(2048, 5632), (512, 1536)], ids=["16-warp", "8-warp"])
@pytest.mark.parametrize("mix", ["q8_0", "q4_k_m"])
def test_a_step_with_the_hand_off_gives_the_same_bits(cp, hidden, ffn, mix):
    cfg = _cfg(hidden, ffn)
    on, handed = _logits(cfg, mix, Tuning(splits=8))
    off, none = _logits(cfg, mix, Tuning(gemv=GemvTuning(quant_handoff=False), splits=8))
    eager, _ = _logits(cfg, mix, Tuning(splits=8), use_graph=False)
    assert handed == cfg.num_layers and none == 0
    assert np.isfinite(on).all()
    assert np.array_equal(on, off)
    assert np.array_equal(on, eager)


def test_gamma_copied_early_gives_the_same_bits(cp):
    """GAMMA_EARLY changes where gamma is read from, not a single product."""
    cfg = _cfg(2048, 5632)
    early, _ = _logits(cfg, "q4_k_m", Tuning(splits=8), steps=16)
    late, _ = _logits(cfg, "q4_k_m", Tuning(gemv=GemvTuning(quant_gamma_early=False), splits=8), steps=16)
    assert np.array_equal(early, late)
