"""The prefill over block-format matrices on the GPU: dequant_rows of any row range, every format and
store variant, bit for bit against gguf's dequantization rounded to bf16, with the rows around the
range left alone; and whole prefills of tiny mixed-type GGUFs whose next matrix is dequantized ahead
on a side stream, giving the same bits as one stream over several chunks and repeated runs."""

from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest

from kernels import quant_layout as L
from kernels.tuning import PrefillTuning, Tuning
from tests.test_quant_gpu import LAYERS, SHAPES, quant, row_k, run_launches

pytestmark = pytest.mark.gpu
BF16 = ml_dtypes.bfloat16
POISON = 0x7FC1
ONE_STREAM = PrefillTuning(chunk=16, dequant_ahead=False)


@pytest.fixture(scope="module")
def cp():
    import cupy

    from kernels.cuda import init

    init()
    return cupy


def bf16_bits(wf: np.ndarray) -> np.ndarray:
    return wf.astype(BF16).view(np.uint16)


@pytest.mark.parametrize("fmt", list(L.FORMATS))
@pytest.mark.parametrize("items,stage", [(1, False), (4, False), (1, True), (2, True)])
@pytest.mark.parametrize("kind", ["awkward", "passes"])
def test_dequant_rows_of_a_range(cp, fmt, items, stage, kind):
    from kernels.prefill_ops import dequant_rows

    rows, k = 301, row_k(fmt, kind)
    w, wf = quant(cp, fmt, rows, k, seed=7)
    for r0, n in [(0, rows), (0, 1), (37, 133), (rows - 5, 5)]:
        out = cp.full((n + 2, k), POISON, cp.uint16)  # a guard row either side
        run_launches(cp, [dequant_rows(w, out[1:].data.ptr, r0, n, items=items, stage=stage)])
        got = out.get()
        assert np.array_equal(got[1:-1], bf16_bits(wf[r0 : r0 + n])), (r0, n)
        assert (got[0] == POISON).all() and (got[-1] == POISON).all()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def models(request, tmp_path_factory):
    from engine.gguf_model import load_gguf
    from tests.gguf_files import every_format_mix, q4_k_m_mix, write_gguf
    from tests.tiny import make_tiny_model

    d = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_model(d / "hf", request.param, hidden=256, head_dim=64, intermediate=512, layers=LAYERS, seed=5,
                         **SHAPES[request.param])
    out = {}
    for name, mix, seed in (("q4km", q4_k_m_mix(LAYERS), 2), ("mixed", every_format_mix(LAYERS), 3)):
        cfg, w, _ = load_gguf(write_gguf(hf, d / f"{name}.gguf", mix, seed=seed), tokenizer=False)
        out[name] = cfg, w
    return out


def prefill_bits(cp, cfg, weights, bufs, stream, tuning: PrefillTuning, runs):
    """[(x, logits or None, K cache, V cache)] after each prefill of `runs` ((ids, start, logits)) on one
    Prefill, every buffer poisoned first."""
    from graphs.prefill import Prefill

    pf = Prefill(cfg, weights, bufs, stream, Tuning(prefill=tuning))
    out = []
    with stream:  # the fills on the prefill's own stream: a non-blocking stream does not wait for the legacy one
        bufs.k_cache.fill(POISON)
        bufs.v_cache.fill(POISON)
        for ids, start, logits in runs:
            pf.x.fill(np.nan)
            pf.logits.fill(np.nan)
            pf.run(ids, start=start, logits=logits)
            stream.synchronize()
            out.append((pf.x.get(), pf.logits.get() if logits else None, bufs.k_cache.get(), bufs.v_cache.get()))
    return out


@pytest.mark.parametrize("mix", ["q4km", "mixed"])
def test_dequantizing_ahead_equals_one_stream(cp, models, mix):
    from graphs.buffers import DecodeBuffers, DeviceWeights
    from kernels.cuda import shared_stream

    cfg, w = models[mix]
    stream = shared_stream()
    with stream:
        weights = DeviceWeights.upload(cfg, w)
        bufs = DecodeBuffers(cfg, 64, 8, 4)
    ids = np.random.default_rng(11).integers(0, cfg.vocab_size, 41)
    # three chunks with logits, one run that stops after the last layer's K/V, then a suffix from 41
    runs = [(ids, 0, True), (ids[:30], 0, False), (ids[:9], 41, True)]
    want = prefill_bits(cp, cfg, weights, bufs, stream, ONE_STREAM, runs)
    assert np.isfinite(want[0][0]).all() and np.isfinite(want[0][1]).all() and (want[0][2] != POISON).any()
    for tuning in (PrefillTuning(chunk=16), PrefillTuning(chunk=7), PrefillTuning()):
        got = prefill_bits(cp, cfg, weights, bufs, stream, tuning, runs)
        if tuning.chunk != 16:  # another chunking sums attention in another order: compare within the run
            want_t = prefill_bits(cp, cfg, weights, bufs, stream, replace(tuning, dequant_ahead=False), runs)
        else:
            want_t = want
        for g_run, e_run in zip(got, want_t, strict=True):
            for g, e, name in zip(g_run, e_run, ("x", "logits", "k cache", "v cache"), strict=True):
                assert (g is None and e is None) or np.array_equal(g.view(np.uint8), e.view(np.uint8)), (name, tuning)
