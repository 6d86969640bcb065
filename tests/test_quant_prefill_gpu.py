"""The prefill over block-format matrices on the GPU: dequant_rows of any row range, every format and
store variant, bit for bit against gguf's dequantization rounded to bf16 (NaN as the kernels write
it), with the rows around the range left alone; and whole prefills of tiny mixed-type GGUFs whose
matrices are sliced at sizes that divide no row count, over one to three lanes, giving the same
bits as the matrices dequantized whole."""

import ml_dtypes
import numpy as np
import pytest

from kernels import quant_layout as L
from kernels.tuning import PrefillTuning, Tuning
from tests.test_quant_gpu import LAYERS, SHAPES, awkward_k, quant, run_launches

pytestmark = pytest.mark.gpu
BF16 = ml_dtypes.bfloat16
POISON = 0x7FC1
WHOLE = PrefillTuning(chunk=16, dequant_slice=0, dequant_lanes=1, dequant_items=1, dequant_stage=False)


@pytest.fixture(scope="module")
def cp():
    import cupy

    from kernels.cuda import init

    init()
    return cupy


def bf16_bits(wf: np.ndarray) -> np.ndarray:
    want = wf.astype(BF16).view(np.uint16).copy()
    want[np.isnan(wf)] = 0x7FC0  # the kernels' NaN, whatever the sign
    return want


@pytest.mark.parametrize("fmt", list(L.FORMATS))
@pytest.mark.parametrize("items,stage", [(1, False), (4, False), (1, True), (4, True), (3, True)])
def test_dequant_rows_of_a_range(cp, fmt, items, stage):
    from kernels.prefill_ops import dequant_rows

    rows, k = 301, awkward_k(fmt)
    w, wf = quant(cp, fmt, rows, k, seed=7)
    for r0, n in [(0, rows), (0, 1), (37, 133), (rows - 5, 5)]:
        out = cp.full((n + 2, k), POISON, cp.uint16)  # a guard row either side
        run_launches(cp, [dequant_rows(w, out[1:].data.ptr, r0, n, items=items, stage=stage)])
        got = out.get()
        assert np.array_equal(got[1:-1], bf16_bits(wf[r0 : r0 + n])), (r0, n)
        assert (got[0] == POISON).all() and (got[-1] == POISON).all()


@pytest.mark.parametrize("stage", [False, True])
def test_dequant_rows_keeps_nan_and_inf(cp, stage):
    """A Q8_0 block whose fp16 scale is NaN, one whose scale is inf (inf * 0 is NaN)."""
    from gguf import GGMLQuantizationType as GT
    from gguf.quants import dequantize

    from graphs.quant_weights import repack_on_device
    from kernels.prefill_ops import dequant_rows

    rows, k = 9, 256
    raw = L.random_blocks("q8_0", rows, k, seed=3, scale=0.1).copy()
    raw[0, 0:2] = np.array([0x7E00], np.uint16).view(np.uint8)
    raw[2, 34:36] = np.array([0x7C00], np.uint16).view(np.uint8)
    raw[2, 36] = 0
    raw[4, 0:2] = np.array([0xFE00], np.uint16).view(np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):
        wf = dequantize(raw, GT.Q8_0).reshape(rows, k)
    assert np.isnan(wf).any() and np.isinf(wf).any()
    out = cp.full((rows, k), POISON, cp.uint16)
    run_launches(cp, [dequant_rows(repack_on_device("q8_0", raw, rows, k), out, 0, rows, stage=stage)])
    assert np.array_equal(out.get(), bf16_bits(wf))


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


def prefill_bits(cp, cfg, weights, bufs, stream, tuning: PrefillTuning, ids):
    """(x, logits, K cache, V cache) after a prefill of ids with logits, every buffer poisoned first."""
    from graphs.prefill import Prefill

    bufs.k_cache.fill(POISON)
    bufs.v_cache.fill(POISON)
    pf = Prefill(cfg, weights, bufs, stream, Tuning(prefill=tuning))
    pf.x.fill(np.nan)
    pf.logits.fill(np.nan)
    pf.run(ids, logits=True)
    stream.synchronize()
    return pf.x.get(), pf.logits.get(), bufs.k_cache.get(), bufs.v_cache.get()


# slice bytes: 100 rows of 256 (50 of the down projection's 512), 37 rows, one row; over 1 to 3 lanes
SLICED = [
    PrefillTuning(chunk=16, dequant_slice=2 * 256 * 100, dequant_lanes=1),
    PrefillTuning(chunk=16, dequant_slice=2 * 256 * 100, dequant_lanes=2, dequant_items=3, dequant_stage=False),
    PrefillTuning(chunk=16, dequant_slice=2 * 256 * 37 + 5, dequant_lanes=3),
    PrefillTuning(chunk=16, dequant_slice=2 * 512, dequant_lanes=2, dequant_items=1, dequant_stage=True),
    PrefillTuning(chunk=16),
]


@pytest.mark.parametrize("mix", ["q4km", "mixed"])
def test_sliced_prefill_equals_whole_matrices(cp, models, mix):
    from graphs.buffers import DecodeBuffers, DeviceWeights
    from kernels.cuda import shared_stream

    cfg, w = models[mix]
    stream = shared_stream()
    with stream:
        weights = DeviceWeights.upload(cfg, w)
        bufs = DecodeBuffers(cfg, 64, 8, 4)
    ids = np.random.default_rng(11).integers(0, cfg.vocab_size, 41)
    want = prefill_bits(cp, cfg, weights, bufs, stream, WHOLE, ids)
    assert np.isfinite(want[0]).all() and np.isfinite(want[1]).all()
    assert (want[2] != POISON).any()
    for tuning in SLICED:
        got = prefill_bits(cp, cfg, weights, bufs, stream, tuning, ids)
        for g, e, name in zip(got, want, ("x", "logits", "k cache", "v cache"), strict=True):
            assert np.array_equal(g.view(np.uint8), e.view(np.uint8)), (name, tuning)
