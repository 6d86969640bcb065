"""GPU: where a GEMV loads its first batch of weights (before or after the PDL wait, gemv_core.cuh
EARLY_BATCH) changes when the bytes arrive, never a product: whole steps give the same bits either way."""

from __future__ import annotations

import numpy as np
import pytest

from kernels.tuning import GemvTuning, Tuning

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cp():
    import cupy

    from kernels.cuda import init

    init()
    return cupy


def model_cfg(hidden: int = 2048, inter: int = 5632, heads: int = 16, kv_heads: int = 4, hd: int = 128):
    """Three layers; by default rows of 2,048 weights (one 16-warp block per SM for the block formats) and of
    5,632 (down)."""
    from engine.config import ModelConfig

    return ModelConfig(arch="llama", vocab_size=1000, hidden_size=hidden, intermediate_size=inter, num_layers=3,
                       num_heads=heads, num_kv_heads=kv_heads, head_dim=hd, rms_norm_eps=1e-5, rope_theta=10000.0,
                       max_position_embeddings=256, tie_word_embeddings=False, attention_bias=False,
                       qk_norm=False)


def step_logits(cfg, quant: str, tuning: Tuning, use_graph: bool = True, steps: int = 24) -> np.ndarray:
    """[steps, vocab] logits of a random model in this format, one replay (or eager step) each."""
    from engine.backend_cuda import CudaBackend

    be = CudaBackend(cfg, None, max_context=128, tuning=tuning, use_graph=use_graph, seed=5, random_quant=quant)
    be.start([3, 14, 15, 92, 65])
    out = []
    for _ in range(steps):
        be.replay()
        out.append(be.step_logits())
    return np.stack(out)


@pytest.mark.parametrize("quant", ["q8_0", "q4_0"])
def test_the_late_first_batch_gives_the_same_bits(cp, quant):
    cfg = model_cfg()
    late = step_logits(cfg, quant, Tuning(splits=8))
    early = step_logits(cfg, quant, Tuning(gemv=GemvTuning(quant_late_formats=()), splits=8))
    eager = step_logits(cfg, quant, Tuning(splits=8), use_graph=False)
    assert np.isfinite(late).all() and np.ptp(late[-1]) > 0
    assert np.array_equal(late, early)
    assert np.array_equal(late, eager)

