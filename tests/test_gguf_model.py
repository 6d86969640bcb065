"""A .gguf file run as it is: weights kept quantized, the numpy path equal to import-gguf, loader errors."""

import numpy as np
import pytest

pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as GT
from gguf import GGUFReader

from engine.config import ModelConfig
from engine.errors import GDecodeError
from engine.gguf_import import dequantize_tensor, import_gguf, unpermute
from engine.gguf_model import load_gguf
from engine.quant import QuantMatrix, QuantStack
from engine.qweights import arrays, dequantized, device_bytes
from engine.reference import ReferenceModel
from engine.tokenizer import Tokenizer
from engine.weights import load_weights
from tests.gguf_files import every_format_mix, q4_k_m_mix, write_gguf
from tests.test_cli import assert_one_line_error, gdecode
from tests.tiny import make_tiny_model

LAYERS = 2
PROMPT = [5, 77, 140, 9, 230, 31, 64]
SHAPES = {"llama": dict(tied=False, heads=4, kv_heads=2), "qwen2": dict(tied=True, heads=4, kv_heads=1)}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def hf(request, tmp_path_factory):
    """A tiny float32 checkpoint with hidden 256, so every K format's 256-blocks fit its rows."""
    d = tmp_path_factory.mktemp(request.param) / "hf"
    return make_tiny_model(d, request.param, hidden=256, head_dim=64, intermediate=512, layers=LAYERS,
                           seed=3, **SHAPES[request.param])


@pytest.fixture(scope="module")
def q4km(hf):
    return write_gguf(hf, hf.parent / "q4km.gguf", q4_k_m_mix(LAYERS))


@pytest.fixture(scope="module")
def mixed(hf):
    return write_gguf(hf, hf.parent / "mixed.gguf", every_format_mix(LAYERS), seed=1)


def _logits(cfg, weights, ids=PROMPT):
    return ReferenceModel(cfg, weights, max_context=64).prefill(ids, return_all=True)


def _imported(path, tmp_path):
    out = import_gguf(path, tmp_path / "imported", progress=False)
    cfg = ModelConfig.from_dir(out)
    return out, cfg, load_weights(out, cfg)


def _same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint16), b.view(np.uint16))


def test_q4_k_m_stays_quantized_and_mapped(q4km):
    cfg, w, _ = load_gguf(q4km)
    lw = w.layers[0]
    assert isinstance(lw.wqkv, QuantStack) and [p.qtype for p in lw.wqkv.parts] == ["q4_k", "q4_k", "q6_k"]
    assert lw.wqkv.shape == (cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size)
    assert isinstance(lw.w_gate_up, QuantStack) and lw.w_gate_up.rows == 2 * cfg.intermediate_size
    assert lw.w_down.qtype == "q6_k" and w.layers[1].w_down.qtype == "q4_k"
    assert isinstance(w.embed, QuantMatrix) and w.embed.qtype == "q4_k"
    assert (w.lm_head is w.embed) == cfg.tie_word_embeddings
    # v is stored as it is: a read-only view into the mapped file, not a copy
    v = lw.wqkv.parts[2].data
    assert not v.flags.writeable and v.base is not None
    assert lw.w_down.data.shape == (cfg.hidden_size, cfg.intermediate_size // 256 * 210)
    assert lw.attn_norm.dtype == np.float32
    quant = sum(a.nbytes for a in arrays(w) if isinstance(a, (QuantMatrix, QuantStack)))
    assert device_bytes(w) == quant + 4 * sum(a.size for a in arrays(w) if isinstance(a, np.ndarray))


@pytest.fixture(params=["q4km", "mixed"])
def either(request, q4km, mixed):
    return {"q4km": q4km, "mixed": mixed}[request.param]


def test_numpy_weights_and_logits_equal_the_import(either, tmp_path):
    path = either
    cfg, w, tok = load_gguf(path)
    out, icfg, iw = _imported(path, tmp_path)
    assert cfg == icfg
    dw = dequantized(w)
    assert _same(dw.embed, iw.embed) and _same(dw.lm_head, iw.lm_head) and _same(dw.final_norm, iw.final_norm)
    for a, b in zip(dw.layers, iw.layers, strict=True):
        for k, x in vars(a).items():
            assert (x is None) == (getattr(b, k) is None), k
            assert x is None or _same(x, getattr(b, k)), k
    np.testing.assert_array_equal(_logits(cfg, dw), _logits(icfg, iw))
    itok = Tokenizer.from_dir(out, icfg)
    text = "Once upon a time, 12 foxes said hello."
    assert tok.encode(text) == itok.encode(text) and tok.eos_ids == itok.eos_ids and tok.bos_id == itok.bos_id
    chat = [{"role": "user", "content": "hi"}]
    assert tok.encode_chat(chat) == itok.encode_chat(chat)


def test_mixed_file_has_every_format(mixed):
    _, w, _ = load_gguf(mixed)
    kinds = set()
    for a in arrays(w):
        if isinstance(a, QuantStack):
            kinds |= {p.qtype for p in a.parts}
        elif isinstance(a, QuantMatrix):
            kinds.add(a.qtype)
    assert kinds == {"q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k"}


def test_quantized_file_follows_the_float_model(hf, q4km):
    """The file is the float model quantized: every matrix stays near the float one (Q/K rows back in
    Hugging Face order), and a Q8_0 file's logits near the float model's (config and rotary layout)."""
    cfg = ModelConfig.from_dir(hf)
    ref = load_weights(hf, cfg)
    _, w, _ = load_gguf(q4km)
    d = dequantized(w, round_bf16=False)
    pairs = [(d.embed, ref.embed), (d.lm_head, ref.lm_head)]
    pairs += [(getattr(a, k), getattr(b, k)) for a, b in zip(d.layers, ref.layers, strict=True)
              for k in ("wqkv", "wo", "w_gate_up", "w_down")]
    for got, want in pairs:
        assert np.abs(got - want).max() <= 0.07 * np.abs(want).max()
    want = _logits(cfg, ref)
    q8 = write_gguf(hf, hf.parent / "q8.gguf", {k: "q8_0" for k in q4_k_m_mix(LAYERS)})
    gcfg, w8, _ = load_gguf(q8)
    got = _logits(gcfg, dequantized(w8, round_bf16=False))
    np.testing.assert_allclose(got, want, atol=0.1 * np.abs(want).max())


def test_dense_gguf_keeps_dtypes(hf, tmp_path):
    mix = {"token_embd": "f16", "blk.0.attn_q": "bf16", "blk.0.attn_k": "bf16", "blk.0.attn_v": "bf16",
           "blk.1.attn_q": "f16", "blk.1.attn_k": "q8_0", "blk.1.attn_v": "f16"}
    path = write_gguf(hf, tmp_path / "dense.gguf", mix)
    cfg, w, _ = load_gguf(path)
    assert w.embed.dtype == np.float16 and w.layers[0].wqkv.dtype.name == "bfloat16"
    assert w.layers[0].w_down.dtype == np.float32
    # a dense part beside a quantized one: the stack is float32, ggml's values exactly
    stack = w.layers[1].wqkv
    assert stack.dtype == np.float32
    t = next(t for t in GGUFReader(path).tensors if t.name == "blk.1.attn_k.weight")
    k = dequantize_tensor(t.data, t.tensor_type, (cfg.kv_size, cfg.hidden_size))
    k = unpermute(k, cfg.num_kv_heads) if cfg.arch == "llama" else k
    np.testing.assert_array_equal(stack[cfg.q_size : cfg.q_size + cfg.kv_size], k)
    _, icfg, iw = _imported(path, tmp_path)
    np.testing.assert_array_equal(_logits(cfg, dequantized(w)), _logits(icfg, iw))


# ---- the command line ----


def _tokens_out(r):
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_cli_numpy_tokens_equal_import_then_generate(q4km, tmp_path):
    out = tmp_path / "imported"
    assert gdecode("import-gguf", q4km, out, "--no-progress").returncode == 0
    args = ("generate", "The quick brown", "-n", "12", "--temperature", "0", "--backend", "numpy")
    a = _tokens_out(gdecode(*args, "-m", q4km))
    b = _tokens_out(gdecode(*args, "-m", out))
    assert a == b and len(a.strip()) > 0


def test_cli_info_lists_tensor_types(q4km):
    r = gdecode("info", "-m", q4km)
    assert r.returncode == 0, r.stderr
    types = [t.tensor_type for t in GGUFReader(q4km).tensors]
    for t in (GT.Q4_K, GT.Q6_K, GT.F32):
        assert f"{t.name}: {types.count(t)} tensors" in r.stdout, r.stdout
    _, w, _ = load_gguf(q4km)
    mb = device_bytes(w) / 1e6
    assert f"on the device: {mb:.2f} MB" in r.stdout


def test_cli_quantize_refuses_a_quantized_model(q4km):
    assert_one_line_error(gdecode("generate", "hi", "-m", q4km, "--backend", "numpy", "--quantize", "q8_0"),
                          "already quantized", "Q4_K, Q6_K")


def test_cli_quantize_refuses_a_quantization_config(hf, tmp_path):
    import json
    import shutil

    d = shutil.copytree(hf, tmp_path / "gptq")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "gptq", "bits": 4}}))
    assert_one_line_error(gdecode("generate", "hi", "-m", d, "--backend", "numpy", "--quantize", "q4_0"),
                          "already quantized (gptq)")


def test_cli_quantize_a_dense_gguf_like_its_import(hf, tmp_path):
    path = write_gguf(hf, tmp_path / "f16.gguf", {k: "f16" for k in q4_k_m_mix(LAYERS)})
    out = tmp_path / "imported"
    assert gdecode("import-gguf", path, out, "--no-progress").returncode == 0
    args = ("generate", "The quick brown", "-n", "8", "--temperature", "0", "--backend", "numpy", "--quantize", "q4_0")
    assert _tokens_out(gdecode(*args, "-m", path)) == _tokens_out(gdecode(*args, "-m", out))


def test_cli_quantize_unknown_format(hf):
    assert_one_line_error(gdecode("generate", "hi", "-m", hf, "--backend", "numpy", "--quantize", "q3_k"),
                          "unknown format", "q8_0, q4_0")


def test_cli_unsupported_tensor_type(hf, tmp_path):
    path = write_gguf(hf, tmp_path / "iq.gguf", {"blk.1.ffn_up": "q4_0"})
    data = bytearray(path.read_bytes())
    _retype(data, b"blk.1.ffn_up.weight", GT.Q4_0, GT.IQ4_NL)  # same block and type size: the data still fits
    path.write_bytes(bytes(data))
    for cmd in ("generate", "info"):
        args = (cmd, "hi", "-m", path) if cmd == "generate" else (cmd, "-m", path)
        assert_one_line_error(gdecode(*args), "blk.1.ffn_up.weight", "IQ4_NL", "Q4_K", "Q6_K")


def _retype(data: bytearray, name: bytes, old: GT, new: GT):
    # tensor info: name, n_dims (u32), dims (u64 each), type (u32), offset (u64)
    at = data.index(name) + len(name)
    n_dims = int.from_bytes(data[at : at + 4], "little")
    t = at + 4 + 8 * n_dims
    assert int.from_bytes(data[t : t + 4], "little") == old
    data[t : t + 4] = int(new).to_bytes(4, "little")
    return at + 4


def test_truncated_file(q4km, tmp_path):
    data = q4km.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(GDecodeError, match="truncated"):
        load_gguf(cut)
    assert_one_line_error(gdecode("generate", "hi", "-m", cut, "--backend", "numpy"), "truncated")


def test_block_count_not_matching_shape(hf, tmp_path):
    path = write_gguf(hf, tmp_path / "b.gguf", {"blk.0.ffn_up": "q8_0"})
    data = bytearray(path.read_bytes())
    at = _retype(data, b"blk.0.ffn_up.weight", GT.Q8_0, GT.Q8_0)
    data[at : at + 8] = (256 + 16).to_bytes(8, "little")  # a row of 272 values is not whole 32-blocks
    path.write_bytes(bytes(data))
    assert_one_line_error(gdecode("info", "-m", path), str(path), "blk.0.ffn_up.weight", "not whole Q8_0 blocks")


def test_unsupported_architecture(hf, tmp_path):
    path = write_gguf(hf, tmp_path / "a.gguf")
    arch = ModelConfig.from_dir(hf).arch.encode()
    data = path.read_bytes()
    length = len(arch).to_bytes(8, "little")  # the first such string is general.architecture's value
    path.write_bytes(data.replace(length + arch, length + b"gemma", 1))
    assert_one_line_error(gdecode("generate", "hi", "-m", path, "--backend", "numpy"), "'gemma'", "not supported")


def test_missing_gguf(tmp_path):
    assert_one_line_error(gdecode("info", "-m", tmp_path / "none.gguf"), "no such file")
