"""import-gguf on small synthetic GGUF files: dequantizers, weights, config, tokenizer, errors."""

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gguf")  # a runtime dependency; absent only on bare GPU images
import torch
from gguf import GGML_QUANT_SIZES, GGUFValueType, GGUFWriter
from gguf import GGMLQuantizationType as Q
from gguf.gguf_writer import GGUFValue
from gguf.quants import quantize
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from engine.config import ModelConfig
from engine.errors import GDecodeError
from engine.gguf_import import dequantize_tensor, import_gguf, unpermute
from engine.reference import ReferenceModel
from engine.weights import load_weights

ROOT = Path(__file__).resolve().parent.parent

# ---- scalar dequantizers, transcribed from ggml-quants.c dequantize_row_* ----


def _f16(b, o):
    return float(np.frombuffer(bytes(b[o : o + 2]), np.float16)[0])


def _ref_q4_0(b):
    d, qs, y = _f16(b, 0), b[2:18], [0.0] * 32
    for j in range(16):
        y[j], y[j + 16] = ((qs[j] & 0xF) - 8) * d, ((qs[j] >> 4) - 8) * d
    return y


def _ref_q4_1(b):
    d, m, qs, y = _f16(b, 0), _f16(b, 2), b[4:20], [0.0] * 32
    for j in range(16):
        y[j], y[j + 16] = (qs[j] & 0xF) * d + m, (qs[j] >> 4) * d + m
    return y


def _q5(qh, qs, j):
    x0 = (qs[j] & 0xF) | (((qh >> j) << 4) & 0x10)
    x1 = (qs[j] >> 4) | ((qh >> (j + 12)) & 0x10)
    return x0, x1


def _ref_q5_0(b):
    d, qh, qs, y = _f16(b, 0), int.from_bytes(bytes(b[2:6]), "little"), b[6:22], [0.0] * 32
    for j in range(16):
        x0, x1 = _q5(qh, qs, j)
        y[j], y[j + 16] = (x0 - 16) * d, (x1 - 16) * d
    return y


def _ref_q5_1(b):
    d, m, qh, qs, y = _f16(b, 0), _f16(b, 2), int.from_bytes(bytes(b[4:8]), "little"), b[8:24], [0.0] * 32
    for j in range(16):
        x0, x1 = _q5(qh, qs, j)
        y[j], y[j + 16] = x0 * d + m, x1 * d + m
    return y


def _ref_q8_0(b):
    d = _f16(b, 0)
    return [int(q) * d for q in np.frombuffer(bytes(b[2:34]), np.int8)]


def _ref_q2_k(b):
    scales, qs, d, dmin = b[0:16], b[16:80], _f16(b, 80), _f16(b, 82)
    y, i = [], 0
    for q in (0, 32):
        for shift in (0, 2, 4, 6):
            for half in (0, 16):
                sc = scales[i]
                i += 1
                y += [d * (sc & 0xF) * ((qs[q + half + l] >> shift) & 3) - dmin * (sc >> 4) for l in range(16)]
    return y


def _ref_q3_k(b):
    hm, qs, d = b[0:32], b[32:96], _f16(b, 108)
    aux = list(struct.unpack("<3I", bytes(b[96:108]))) + [0]
    k1, k2, tmp = 0x03030303, 0x0F0F0F0F, aux[2]
    aux[2] = ((aux[0] >> 4) & k2) | (((tmp >> 4) & k1) << 4)
    aux[3] = ((aux[1] >> 4) & k2) | (((tmp >> 6) & k1) << 4)
    aux[0] = (aux[0] & k2) | (((tmp >> 0) & k1) << 4)
    aux[1] = (aux[1] & k2) | (((tmp >> 2) & k1) << 4)
    scales = np.frombuffer(struct.pack("<4I", *aux), np.int8)
    y, i, m = [], 0, 1
    for q in (0, 32):
        for shift in (0, 2, 4, 6):
            for half in (0, 16):
                dl = d * (int(scales[i]) - 32)
                i += 1
                y += [dl * (((qs[q + half + l] >> shift) & 3) - (0 if hm[half + l] & m else 4)) for l in range(16)]
            m <<= 1
    return y


def _scale_min_k4(j, q):
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def _ref_q4_k(b):
    d, dmin, sc, qs = _f16(b, 0), _f16(b, 2), b[4:16], b[16:144]
    y = []
    for n in range(4):
        (s1, m1), (s2, m2) = _scale_min_k4(2 * n, sc), _scale_min_k4(2 * n + 1, sc)
        y += [d * s1 * (qs[32 * n + l] & 0xF) - dmin * m1 for l in range(32)]
        y += [d * s2 * (qs[32 * n + l] >> 4) - dmin * m2 for l in range(32)]
    return y


def _ref_q5_k(b):
    d, dmin, sc, qh, ql = _f16(b, 0), _f16(b, 2), b[4:16], b[16:48], b[48:176]
    y = []
    for n in range(4):
        (s1, m1), (s2, m2) = _scale_min_k4(2 * n, sc), _scale_min_k4(2 * n + 1, sc)
        u1, u2 = 1 << (2 * n), 2 << (2 * n)
        y += [d * s1 * ((ql[32 * n + l] & 0xF) + (16 if qh[l] & u1 else 0)) - dmin * m1 for l in range(32)]
        y += [d * s2 * ((ql[32 * n + l] >> 4) + (16 if qh[l] & u2 else 0)) - dmin * m2 for l in range(32)]
    return y


def _ref_q6_k(b):
    ql, qh, d = b[0:128], b[128:192], _f16(b, 208)
    sc = np.frombuffer(bytes(b[192:208]), np.int8).astype(int)
    y = [0.0] * 256
    for n in range(2):
        lo, hi, s, base = 64 * n, 32 * n, 8 * n, 128 * n
        for l in range(32):
            i, h = l // 16, qh[hi + l]
            q1 = ((ql[lo + l] & 0xF) | ((h & 3) << 4)) - 32
            q2 = ((ql[lo + l + 32] & 0xF) | (((h >> 2) & 3) << 4)) - 32
            q3 = ((ql[lo + l] >> 4) | (((h >> 4) & 3) << 4)) - 32
            q4 = ((ql[lo + l + 32] >> 4) | (((h >> 6) & 3) << 4)) - 32
            for k, q in enumerate((q1, q2, q3, q4)):
                y[base + l + 32 * k] = d * sc[s + i + 2 * k] * q
    return y


def _ref_bf16(b):
    return [struct.unpack("<f", struct.pack("<I", int.from_bytes(bytes(b[i : i + 2]), "little") << 16))[0]
            for i in range(0, len(b), 2)]


def _ref_f16(b):
    return [_f16(b, i) for i in range(0, len(b), 2)]


# type -> (scalar reference, bytes per block, offsets of fp16 scales to make finite, scale magnitude)
REFS = {
    Q.Q4_0: (_ref_q4_0, 18, (0,), 0.01),
    Q.Q4_1: (_ref_q4_1, 20, (0, 2), 0.01),
    Q.Q5_0: (_ref_q5_0, 22, (0,), 0.01),
    Q.Q5_1: (_ref_q5_1, 24, (0, 2), 0.01),
    Q.Q8_0: (_ref_q8_0, 34, (0,), 0.001),
    Q.Q2_K: (_ref_q2_k, 84, (80, 82), 0.002),
    Q.Q3_K: (_ref_q3_k, 110, (108,), 0.001),
    Q.Q4_K: (_ref_q4_k, 144, (0, 2), 0.0002),
    Q.Q5_K: (_ref_q5_k, 176, (0, 2), 0.0001),
    Q.Q6_K: (_ref_q6_k, 210, (208,), 0.00005),
}


def random_blocks(qtype, n_blocks, rng):
    """Random quantized blocks whose fp16 scales are finite and small."""
    _, size, scales, mag = REFS[qtype]
    blocks = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    for o in scales:
        d = (rng.uniform(0.5, 1.0, n_blocks) * mag).astype(np.float16)
        blocks[:, o : o + 2] = d.view(np.uint8).reshape(n_blocks, 2)
    return blocks


@pytest.mark.parametrize("qtype", list(REFS), ids=lambda q: q.name)
def test_dequantizer_matches_ggml_reference(qtype):
    rng = np.random.default_rng(int(qtype))
    ref, size, _, _ = REFS[qtype]
    per_block = 256 if size in (84, 110, 144, 176, 210) else 32
    blocks = random_blocks(qtype, 6, rng)
    got = dequantize_tensor(blocks.reshape(2, -1), qtype, (2, 3 * per_block))
    want = np.array([v for blk in blocks for v in ref([int(x) for x in blk])], np.float64).reshape(2, -1)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16], ids=lambda q: q.name)
def test_float_types_match_reference(qtype):
    x = np.random.default_rng(0).standard_normal(64).astype(np.float32)
    raw = (x.astype(np.float16) if qtype == Q.F16 else quantize(x, Q.BF16)).view(np.uint8)
    ref = _ref_f16 if qtype == Q.F16 else _ref_bf16
    want = np.array(ref([int(x) for x in raw]), np.float32)
    np.testing.assert_array_equal(dequantize_tensor(raw, qtype, (64,)), want)


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(8 * 64 * 3, dtype=np.float32).reshape(8 * 64, 3)
    n_head = 8
    # convert_hf_to_gguf.py: LlamaModel.permute
    permuted = w.reshape(n_head, 2, w.shape[0] // n_head // 2, 3).swapaxes(1, 2).reshape(w.shape)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(unpermute(permuted, n_head), w)


# ---- synthetic GGUF files ----

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ Ġ", "ĠĠ Ġ", "ĠĠ ĠĠ", "1 2", "Ġ 1", "Ċ Ċ", "Ġ (", "' s"]
USER = ["<think>", "</think>"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
H, I, NH, NKV, HD, LAYERS = 256, 512, 4, 2, 64, 2
LLAMA_TYPES = {
    "token_embd": Q.Q8_0, "output": Q.Q6_K,
    "0.attn_q": Q.Q4_0, "0.attn_k": Q.Q4_1, "0.attn_v": Q.Q5_0, "0.attn_output": Q.Q5_1,
    "0.ffn_gate": Q.Q4_K, "0.ffn_up": Q.Q5_K, "0.ffn_down": Q.Q6_K,
    "1.attn_q": Q.Q2_K, "1.attn_k": Q.Q3_K, "1.attn_v": Q.F16, "1.attn_output": Q.BF16,
    "1.ffn_gate": Q.Q8_0, "1.ffn_up": Q.Q4_K, "1.ffn_down": Q.F32,
}
QWEN2_TYPES = {
    "token_embd": Q.Q4_K,
    "0.attn_q": Q.Q6_K, "0.attn_k": Q.Q5_K, "0.attn_v": Q.Q8_0, "0.attn_output": Q.Q4_0,
    "0.ffn_gate": Q.Q5_0, "0.ffn_up": Q.Q4_1, "0.ffn_down": Q.Q3_K,
    "1.attn_q": Q.Q8_0, "1.attn_k": Q.F16, "1.attn_v": Q.Q2_K, "1.attn_output": Q.Q6_K,
    "1.ffn_gate": Q.BF16, "1.ffn_up": Q.Q5_1, "1.ffn_down": Q.Q4_K,
}


def vocab():
    alphabet = [bytes_to_unicode()[b] for b in range(256)]
    merged = ["".join(m.split(" ")) for m in MERGES]
    tokens = SPECIALS + alphabet + merged + USER
    types = [3] * len(SPECIALS) + [1] * (256 + len(merged)) + [4] * len(USER)
    return tokens, types


def _tensor(w, qtype, rng):
    if qtype == Q.F32:
        return w, None
    if qtype == Q.F16:
        return w.astype(np.float16), None
    if qtype in (Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0):
        return quantize(w, qtype), qtype
    rows, cols = w.shape
    if qtype not in REFS:  # a type the importer refuses: any bytes will do
        block, size = GGML_QUANT_SIZES[qtype]
        return np.zeros((rows, cols // block * size), np.uint8), qtype
    # no quantizer in gguf-py for k-quants: random blocks with small scales
    return random_blocks(qtype, rows * cols // 256, rng).reshape(rows, -1), qtype


def gpt2_vocab(w, pre="llama-bpe", add_bos=None) -> int:
    """Write the test's byte-level BPE vocabulary into GGUF writer w; returns its size."""
    tokens, token_types = vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.add_chat_template(CHATML)
    return len(tokens)


def write_gguf(path, arch="llama", pre="llama-bpe", types=None, rope_freqs=None, add_bos=None, seed=0,
               vocab_writer=None, meta=None, head_dim=HD):
    """A tiny random llama/qwen2/qwen3 GGUF with the test vocabulary; types: per-tensor GGML types (default F32).

    vocab_writer(w) -> size writes another vocabulary; meta: metadata to set or replace {key: value or
    (value, GGUFValueType)}, or to remove {key: None}."""
    rng = np.random.default_rng(seed)
    hd = head_dim
    types = types or (QWEN2_TYPES if arch == "qwen2" else LLAMA_TYPES)
    w = GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(H)
    w.add_feed_forward_length(I)
    w.add_head_count(NH)
    w.add_head_count_kv(NKV)
    w.add_rope_dimension_count(hd)
    if arch == "qwen3":
        w.add_key_length(hd)
        w.add_value_length(hd)
    w.add_rope_freq_base(500000.0 if rope_freqs is not None else 10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    v = (vocab_writer or (lambda w: gpt2_vocab(w, pre, add_bos)))(w)
    for key, value in (meta or {}).items():  # set, replace (with another type too) or, with None, remove
        if value is None:
            w.kv_data[0].pop(key, None)
            continue
        value, kind = value if isinstance(value, tuple) else (value, None)
        kind = kind or {bool: GGUFValueType.BOOL, int: GGUFValueType.UINT32, float: GGUFValueType.FLOAT32,
                        str: GGUFValueType.STRING, list: GGUFValueType.ARRAY}[type(value)]
        sub = GGUFValueType.get_type(value[0]) if kind == GGUFValueType.ARRAY else None
        w.kv_data[0][key] = GGUFValue(value, kind, sub)
    shapes = {"token_embd": (v, H), "output_norm": (H,)}
    if "output" in types:
        shapes["output"] = (v, H)
    for n in range(LAYERS):
        shapes.update({
            f"{n}.attn_norm": (H,), f"{n}.ffn_norm": (H,),
            f"{n}.attn_q": (NH * hd, H), f"{n}.attn_k": (NKV * hd, H), f"{n}.attn_v": (NKV * hd, H),
            f"{n}.attn_output": (H, NH * hd), f"{n}.ffn_gate": (I, H), f"{n}.ffn_up": (I, H), f"{n}.ffn_down": (H, I),
        })
        if arch == "qwen2":
            shapes.update({f"{n}.attn_q.bias": (NH * hd,), f"{n}.attn_k.bias": (NKV * hd,)})
            shapes[f"{n}.attn_v.bias"] = (NKV * hd,)
        if arch == "qwen3":
            shapes.update({f"{n}.attn_q_norm": (hd,), f"{n}.attn_k_norm": (hd,)})
    for key, shape in shapes.items():
        name = f"blk.{key}" if key[0].isdigit() else key
        name = name if name.endswith(".bias") else name + ".weight"
        if len(shape) == 1:
            x = (1.0 if key.endswith("norm") else 0.0) + 0.1 * rng.standard_normal(shape)
            w.add_tensor(name, x.astype(np.float32))
            continue
        data, raw = _tensor((0.05 * rng.standard_normal(shape)).astype(np.float32), types.get(key, Q.F32), rng)
        w.add_tensor(name, data, raw_dtype=raw)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def gguf_model(path):
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)


def check_model(gguf_path, outdir, ids):
    """Weights equal transformers' own GGUF weights rounded to bf16; logits agree (HF and numpy)."""
    ref, ours = gguf_model(gguf_path), AutoModelForCausalLM.from_pretrained(outdir, dtype=torch.float32)
    a, b = ref.state_dict(), ours.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k].to(torch.bfloat16).float(), b[k]), k
    with torch.no_grad():
        la = ref(torch.tensor([ids])).logits[0].numpy()
        lb = ours(torch.tensor([ids])).logits[0].numpy()
    scale = np.abs(la).max()
    assert np.abs(la - lb).max() <= 0.02 * scale, (np.abs(la - lb).max(), scale)  # bf16 weights
    cfg = ModelConfig.from_dir(outdir)
    ln = ReferenceModel(cfg, load_weights(outdir, cfg), max_context=64).prefill(ids, return_all=True)
    np.testing.assert_allclose(ln, lb, rtol=0, atol=1e-3 * scale)  # same bf16 weights, float32 math
    assert np.abs(la - ln).max() <= 0.02 * scale


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_import_matches_transformers_gguf_loader(tmp_path, arch):
    path = write_gguf(tmp_path / f"{arch}.gguf", arch=arch, pre="qwen2" if arch == "qwen2" else "llama-bpe")
    out = import_gguf(path, tmp_path / "out", progress=False)
    assert sorted(p.name for p in out.iterdir()) == [
        ".gdecode-import", "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json",
    ]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is (arch == "qwen2")
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (NH, NKV, HD)
    check_model(path, out, [1, 40, 270, 7, 260, 99, 2, 5])


def test_llama3_rope_freqs_become_rope_scaling(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    base = 1.0 / 500000.0 ** (np.arange(0, HD, 2) / HD)
    wavelen = 2 * np.pi / base
    smooth = (8192 / wavelen - 1.0) / 3.0
    factors = np.where(wavelen < 8192 / 4, 1.0, np.where(wavelen > 8192, 8.0, 1 / ((1 - smooth) / 8.0 + smooth)))
    out = import_gguf(write_gguf(tmp_path / "l3.gguf", rope_freqs=factors), tmp_path / "out", progress=False)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["rope_scaling"] == scaling
    assert "rope_freqs" not in json.dumps(list(load_weights(out, ModelConfig.from_dir(out)).__dict__))
    np.testing.assert_allclose(ModelConfig.from_dir(out).inv_freq(), base / factors, rtol=1e-6)
    with pytest.raises(GDecodeError, match="rope_freqs"):
        import_gguf(write_gguf(tmp_path / "bad.gguf", rope_freqs=factors[::-1].copy()), tmp_path / "o2")
    assert not (tmp_path / "o2").exists()


TEXTS = [
    "The capital of France is Paris.",
    "Ünïcödé: naïve café, 日本語のテキスト, Ελληνικά, русский текст, مرحبا",
    "def add(a, b):\n    return a + b  # sum\n\nclass X:\n\tpass\n",
    "for (int i = 0; i < n; ++i) { x[i] *= 2; } // 12 + 112",
    "spaces   and\t\ttabs \n\n\n   trailing   ",
    "emoji 🤗🚀 👍🏽 👨‍👩‍👧 🇫🇷!",
    "I'm sure they'll say it's fine, DON'T you think? we've",
    "<|im_start|>user\nhi<|im_end|>\n<think>ok</think>",
    " ",
    "",
]


def check_tokenizer(gguf_path, outdir, texts):
    """tokenizer.json gives transformers' GGUF tokenizer ids, also through AutoTokenizer; and round-trips."""
    ref = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    auto = AutoTokenizer.from_pretrained(outdir)
    tok = Tokenizer.from_file(str(outdir / "tokenizer.json"))
    for s in texts:
        want = ref(s)["input_ids"]
        assert tok.encode(s).ids == want, s
        assert auto(s)["input_ids"] == want, s
        ids = tok.encode(s, add_special_tokens=False).ids
        assert tok.decode(ids, skip_special_tokens=False) == s
        assert auto.decode(ids) == s
    chat = [{"role": "user", "content": "hi"}]
    assert auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == ref.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    )


@pytest.mark.parametrize("pre", ["gpt-2", "smollm", "llama-bpe", "qwen2"])
def test_tokenizer_matches_transformers(tmp_path, pre):
    # Llama 3 files carry add_bos_token=true (transformers does not apply llama.cpp's default for them)
    path = write_gguf(tmp_path / "t.gguf", pre=pre, types={"token_embd": Q.F16}, add_bos=pre == "llama-bpe" or None)
    out = import_gguf(path, tmp_path / "out", progress=False)
    # transformers reads "smollm" as plain GPT-2 and so merges digits: see test_smollm_splits_digits_first
    check_tokenizer(path, out, [t for t in TEXTS if pre != "smollm" or not any(c.isdigit() for c in t)])


@pytest.mark.parametrize(
    "pre, add_bos, want", [("llama-bpe", None, True), ("qwen2", None, False), ("qwen2", True, True)]
)
def test_add_bos(tmp_path, pre, add_bos, want):
    # llama.cpp adds BOS for Llama 3 pre-tokenizers unless the file says otherwise
    out = import_gguf(write_gguf(tmp_path / "t.gguf", pre=pre, add_bos=add_bos), tmp_path / "out", progress=False)
    assert (Tokenizer.from_file(str(out / "tokenizer.json")).encode("hi").ids[0] == 1) is want
    assert json.loads((out / "tokenizer_config.json").read_text())["add_bos_token"] is want


def test_smollm_splits_digits_first(tmp_path):
    # llama.cpp's smollm (and SmolLM2's own tokenizer.json) isolate digits, then apply GPT-2's split;
    # transformers' GGUF reader ignores tokenizer.ggml.pre here, so it differs on whitespace before a digit
    out = import_gguf(write_gguf(tmp_path / "t.gguf", pre="smollm"), tmp_path / "out", progress=False)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.encode("   12").tokens == ["ĠĠĠ", "1", "2"]
    gpt2 = import_gguf(write_gguf(tmp_path / "g.gguf", pre="gpt-2"), tmp_path / "g", progress=False)
    assert Tokenizer.from_file(str(gpt2 / "tokenizer.json")).encode("   12").tokens == ["ĠĠ", "Ġ", "12"]


# ---- errors: one line, non-zero exit, nothing left behind ----


def gdecode(*args):
    cmd = [sys.executable, "-c", "from cli.main import main; main()", *map(str, args)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def assert_clean_failure(r, out, *needles):
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    assert not out.exists()
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(".")] == []


@pytest.fixture(scope="module")
def good_gguf(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("gguf") / "m.gguf")


def test_cli_imports(good_gguf, tmp_path):
    r = gdecode("import-gguf", good_gguf, tmp_path / "a" / "m", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "a" / "m" / "model.safetensors").is_file()


def test_not_gguf(tmp_path):
    (tmp_path / "x.gguf").write_text("hello, not a model\n")
    assert_clean_failure(gdecode("import-gguf", tmp_path / "x.gguf", tmp_path / "out"), tmp_path / "out", "not a GGUF")


@pytest.mark.parametrize("keep", [0.6, 0.002], ids=["in-data", "in-header"])
def test_truncated(good_gguf, tmp_path, keep):
    data = good_gguf.read_bytes()
    (tmp_path / "t.gguf").write_bytes(data[: int(len(data) * keep)])
    assert_clean_failure(gdecode("import-gguf", tmp_path / "t.gguf", tmp_path / "out"), tmp_path / "out", "truncated")


def test_missing_file(tmp_path):
    assert_clean_failure(gdecode("import-gguf", tmp_path / "no.gguf", tmp_path / "out"), tmp_path / "out", "no such")


def test_unsupported_quant_type(tmp_path):
    path = write_gguf(tmp_path / "iq.gguf", types={**LLAMA_TYPES, "0.ffn_up": Q.IQ4_NL})
    r = gdecode("import-gguf", path, tmp_path / "out")
    assert_clean_failure(r, tmp_path / "out", "blk.0.ffn_up.weight", "IQ4_NL", "(supported: F32, F16, BF16, Q8_0")


@pytest.mark.parametrize(
    "kwargs, needle",
    [({"pre": "falcon"}, "pre-tokenizer 'falcon' is not supported (supported: "), ({"arch": "gemma"}, "gemma")],
)
def test_unsupported_model(tmp_path, kwargs, needle):
    path = write_gguf(tmp_path / "m.gguf", **kwargs)
    assert_clean_failure(gdecode("import-gguf", path, tmp_path / "out"), tmp_path / "out", needle)


def test_existing_outdir_needs_force(good_gguf, tmp_path):
    out = tmp_path / "out"
    assert gdecode("import-gguf", good_gguf, out, "--no-progress").returncode == 0
    (out / "config.json").write_text("{}")  # an earlier import, edited: --force may replace it
    r = gdecode("import-gguf", good_gguf, out)
    assert r.returncode != 0 and "--force" in r.stderr and (out / "config.json").read_text() == "{}"
    r = gdecode("import-gguf", good_gguf, out, "--force", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_failure_while_writing_leaves_nothing(good_gguf, tmp_path, monkeypatch):
    import engine.gguf_import as gi

    def boom(e):
        raise GDecodeError("disk full")

    monkeypatch.setattr(gi, "to_bf16", boom)
    with pytest.raises(GDecodeError, match="disk full"):
        gi.import_gguf(good_gguf, tmp_path / "out", progress=False)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("eps, theta", [(1e-5, 10000.0), (1e-6, 1e6), (3.5e-6, 123456.0)])
def test_config_fields_written(tmp_path, eps, theta):
    # eps as the float32 the file holds, printed shortest; EOS, EOT and EOM all stop generation
    meta = {"llama.attention.layer_norm_rms_epsilon": eps, "llama.rope.freq_base": theta,
            "tokenizer.ggml.eot_token_id": 5, "tokenizer.ggml.eom_token_id": 6}
    path = write_gguf(tmp_path / "m.gguf", types={"token_embd": Q.F32}, meta=meta)
    out = import_gguf(path, tmp_path / "out", progress=False)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["rms_norm_eps"] == eps and cfg["rope_theta"] == theta
    assert cfg["eos_token_id"] == [2, 5, 6] and cfg["bos_token_id"] == 1
    assert json.loads((out / "generation_config.json").read_text()) == {"bos_token_id": 1, "eos_token_id": [2, 5, 6]}
    c = ModelConfig.from_dir(out)
    assert (c.rms_norm_eps, c.rope_theta, c.eos_token_ids) == (eps, theta, (2, 5, 6))
    # and transformers' own reading of the file agrees on what it reads
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).config
    assert hf.rms_norm_eps == pytest.approx(eps, rel=1e-6)
    assert hf.rope_parameters["rope_theta"] == pytest.approx(theta)
