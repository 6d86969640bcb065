"""GPU: launches that let the next kernel in before their own PDL wait (Tuning.trigger_first) change when
blocks start, never a product: whole steps give the same bits as with the next kernel let in after the wait,
in every weight format, graph and eager. It gave other logits while the GEMVs read x with non-coherent
loads, which ptxas scheduled above the wait (tests/test_pdl_schedule.py)."""

from __future__ import annotations

import numpy as np
import pytest

from kernels.tuning import TRIGGER_KINDS, Tuning

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cp():
    import cupy

    from kernels.cuda import init

    init()
    return cupy


def _cfg(hidden: int, inter: int, heads: int, kv_heads: int, hd: int):
    from engine.config import ModelConfig

    return ModelConfig(arch="llama", vocab_size=1000, hidden_size=hidden, intermediate_size=inter, num_layers=3,
                       num_heads=heads, num_kv_heads=kv_heads, head_dim=hd, rms_norm_eps=1e-5, rope_theta=10000.0,
                       max_position_embeddings=256, tie_word_embeddings=False, attention_bias=False,
                       qk_norm=False)


# rows of 2,048 (one 16-warp block per SM in the block formats, grids that leave slots free) and of 896
SHAPES = {"2048": (2048, 5632, 16, 4, 128), "896": (896, 4864, 14, 2, 64)}


def _logits(cfg, quant: str, tuning: Tuning, use_graph: bool = True, steps: int = 16):
    from engine.backend_cuda import CudaBackend

    be = CudaBackend(cfg, None, max_context=128, tuning=tuning, use_graph=use_graph, seed=5, random_quant=quant)
    be.start([3, 14, 15, 92, 65])
    out = []
    for _ in range(steps):
        be.replay()
        out.append(be.step_logits())
    return np.stack(out)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("quant", ["bf16", "q8_0", "q4_0", "q4_k_m"])
def test_the_next_kernel_let_in_first_gives_the_same_bits(cp, quant, shape):
    cfg = _cfg(*SHAPES[shape])
    after = _logits(cfg, quant, Tuning(splits=8))
    assert np.isfinite(after).all() and np.ptp(after[-1]) > 0
    for kinds in [("o_proj",), ("qkv_proj", "o_proj"), TRIGGER_KINDS]:
        first = _logits(cfg, quant, Tuning(splits=8, trigger_first=kinds))
        assert np.array_equal(first, after), kinds
    eager = _logits(cfg, quant, Tuning(splits=8, trigger_first=TRIGGER_KINDS), use_graph=False)
    assert np.array_equal(eager, after)
