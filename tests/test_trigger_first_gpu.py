"""GPU: launches that let the next kernel in before their own PDL wait (Tuning.trigger_first) change when
blocks start, never a product: whole steps give the same bits as with the next kernel let in after the wait,
in every weight format, graph and eager. It gave other logits while the GEMVs read x with non-coherent
loads, which ptxas scheduled above the wait (tests/test_pdl_schedule.py)."""

from __future__ import annotations

import numpy as np
import pytest

from kernels.tuning import TRIGGER_KINDS, Tuning
from tests.test_early_batch_gpu import model_cfg, step_logits

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cp():
    import cupy

    from kernels.cuda import init

    init()
    return cupy


# rows of 2,048 (one 16-warp block per SM in the block formats, grids that leave slots free) and of 896
SHAPES = {"2048": (2048, 5632, 16, 4, 128), "896": (896, 4864, 14, 2, 64)}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("quant", ["bf16", "q8_0", "q4_0", "q4_k_m"])
def test_the_next_kernel_let_in_first_gives_the_same_bits(cp, quant, shape):
    cfg = model_cfg(*SHAPES[shape])
    after = step_logits(cfg, quant, Tuning(splits=8))
    assert np.isfinite(after).all() and np.ptp(after[-1]) > 0
    for kinds in [("o_proj",), ("qkv_proj", "o_proj"), TRIGGER_KINDS]:
        first = step_logits(cfg, quant, Tuning(splits=8, trigger_first=kinds))
        assert np.array_equal(first, after), kinds
    eager = step_logits(cfg, quant, Tuning(splits=8, trigger_first=TRIGGER_KINDS), use_graph=False)
    assert np.array_equal(eager, after)
