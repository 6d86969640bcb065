"""import-gguf of sentencepiece vocabularies (Llama 2, Mistral, TinyLlama) and of qwen3 files."""

import io
import json

import numpy as np
import pytest

pytest.importorskip("gguf")
spm = pytest.importorskip("sentencepiece")
from gguf import TokenType  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from engine.config import ModelConfig  # noqa: E402
from engine.gguf_import import import_gguf  # noqa: E402
from engine.gguf_model import dequantized, load_gguf  # noqa: E402
from engine.gguf_spm import merges_from_scores  # noqa: E402
from engine.reference import ReferenceModel  # noqa: E402
from engine.weights import load_weights  # noqa: E402
from tests.test_gguf import check_model, write_gguf  # noqa: E402

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello world, hello tokenizer!",
    "Le renard brun rapide saute par-dessus le chien paresseux. Ça va très bien, merci.",
    "Der schnelle braune Fuchs springt über den faulen Hund. Größe, Straße, Mädchen.",
    "日本語のテキストを分割します。東京は日本の首都です。",
    "Быстрая коричневая лиса прыгает через ленивую собаку.",
    "def main():\n    print('hello 12345')\n    return 0\n",
    "[INST] What is the capital of France? [/INST] Paris.",
]
# words the vocabulary never saw, scripts it lacks (byte fallback), digits, runs of spaces, a leading space
MULTILINGUAL = [
    "Hello world, the lazy fox.",
    "Ça va? Größe und Straße: naïve café, déjà vu.",
    "東京は日本の首都です。日本語のテキスト",
    "Быстрая лиса — ленивая собака.",
    "Ελληνικά και مرحبا بالعالم and עברית",
    "emoji 🤗🚀 👍🏽 👨‍👩‍👧 🇫🇷!",
    "def f(x):\n    return x * 12345  # 0.5\n\n\tend",
    "  two  leading spaces and trailing   ",
    " a",
    "[INST] hi [/INST]",
    "",
]


@pytest.fixture(scope="module")
def sp_model():
    """A Llama-style sentencepiece BPE model (byte fallback, split digits, identity normalization)."""
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 20), model_writer=out, vocab_size=480, model_type="bpe",
        byte_fallback=True, split_digits=True, normalization_rule_name="identity", add_dummy_prefix=True,
        allow_whitespace_only_pieces=True, remove_extra_whitespaces=False, character_coverage=1.0,
        user_defined_symbols=["[INST]", "[/INST]"], unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2,
        num_threads=1,
    )
    return spm.SentencePieceProcessor(model_proto=out.getvalue())


def spm_vocab(sp, **flags):
    """A vocab_writer for write_gguf: the model's pieces, scores and types, as llama.cpp's converter writes them."""

    def write(w):
        tokens, scores, types = [], [], []
        for i in range(sp.get_piece_size()):
            tokens.append(sp.id_to_piece(i))
            scores.append(sp.get_score(i))
            kind = TokenType.NORMAL
            if sp.is_unknown(i):
                kind = TokenType.UNKNOWN
            elif sp.is_control(i):
                kind = TokenType.CONTROL
            elif sp.is_byte(i):
                kind = TokenType.BYTE
            elif tokens[-1] in ("[INST]", "[/INST]"):
                kind = TokenType.USER_DEFINED
            types.append(kind)
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        for key, value in flags.items():
            getattr(w, f"add_{key}")(value)
        w.add_chat_template("{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}")
        return len(tokens)

    return write


@pytest.fixture(scope="module")
def mistral(tmp_path_factory, sp_model):
    """A llama-architecture GGUF with a sentencepiece vocabulary, named as llama.cpp names Mistral files."""
    d = tmp_path_factory.mktemp("mistral")
    path = write_gguf(d / "mistral.gguf", vocab_writer=spm_vocab(sp_model), meta={"general.name": "Mistral 7B Tiny"})
    return path, import_gguf(path, d / "out", progress=False)


def test_sentencepiece_tokenizer_matches_transformers_and_sentencepiece(mistral, sp_model):
    path, out = mistral
    ref = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ours = Tokenizer.from_file(str(out / "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(out)
    for text in MULTILINGUAL:
        ids = ours.encode(text).ids
        assert auto(text)["input_ids"] == ids, text
        if "[INST]" not in text:
            # the original, sentencepiece itself, after llama.cpp's BOS
            assert ids == [1, *sp_model.encode(text)], text
        if not text[:1].isspace() and "[INST]" not in text:
            # transformers' GGUF tokenizer drops the prefix space before a leading space and after a
            # special token (its Metaspace pre-tokenizer); llama.cpp and sentencepiece keep it
            assert ref(text)["input_ids"] == ids, text
        if "[INST]" not in text:  # text after a special token decodes with its added space, as in llama.cpp
            plain = ours.encode(text, add_special_tokens=False).ids
            assert ours.decode(plain) == text == auto.decode(plain), text
    # byte fallback really happened: the vocabulary has no Greek
    assert any(ours.id_to_token(i).startswith("<0x") for i in ours.encode("Ελληνικά").ids)
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["add_bos_token"] is True and config["bos_token"] == "<s>" and config["unk_token"] == "<unk>"


def test_space_prefix_after_special_tokens_as_llama_cpp(mistral, sp_model):
    # llama.cpp: every stretch of text after a special or user-defined token gets its own prefix space
    _, out = mistral
    ours = Tokenizer.from_file(str(out / "tokenizer.json"))
    inst, end = sp_model.piece_to_id("[INST]"), sp_model.piece_to_id("[/INST]")
    assert ours.encode("[INST] hi [/INST]").ids == [1, inst, *sp_model.encode(" hi "), end]
    assert ours.encode("[INST]hi").ids == [1, inst, *sp_model.encode("hi")]


def test_sentencepiece_model_matches_transformers_gguf_loader(mistral):
    path, out = mistral
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    ids = Tokenizer.from_file(str(out / "tokenizer.json")).encode("Größe 東京 12").ids
    check_model(path, out, ids)


def test_no_space_prefix_and_no_bos(tmp_path, sp_model):
    writer = spm_vocab(sp_model, add_space_prefix=False, add_bos_token=False)
    path = write_gguf(tmp_path / "m.gguf", vocab_writer=writer)
    tok = Tokenizer.from_file(str(import_gguf(path, tmp_path / "out", progress=False) / "tokenizer.json"))
    enc = tok.encode("hello world")
    assert enc.tokens[0] == "h" or not enc.tokens[0].startswith("\u2581")
    assert 1 not in enc.ids
    assert tok.decode(enc.ids) == "hello world"


def test_merges_rank_by_score_of_the_joined_token():
    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    scores = [0.0, 0.0, 0.0, -2.0, -1.0, -3.0]
    # bc (-1) before ab (-2) before the two ways to abc (-3): longer left piece first
    assert merges_from_scores(tokens, scores) == [("b", "c"), ("a", "b"), ("ab", "c"), ("a", "bc")]


def test_qwen3_matches_transformers_gguf_loader(tmp_path):
    # head_dim 128 != hidden / heads: transformers' GGUF reader assumes Qwen3's 128 (it skips key_length)
    path = write_gguf(tmp_path / "q3.gguf", arch="qwen3", pre="qwen2", head_dim=128)
    out = import_gguf(path, tmp_path / "out", progress=False)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["head_dim"] == 128
    ids = [1, 40, 270, 7, 260, 99, 2, 5]
    check_model(path, out, ids)
    # run directly from the file (q_norm and k_norm included), as from the imported folder
    config, weights, _ = load_gguf(path, tokenizer=False)
    direct = ReferenceModel(config, dequantized(weights), max_context=16).prefill(ids, return_all=True)
    cfg = ModelConfig.from_dir(out)
    imported = ReferenceModel(cfg, load_weights(out, cfg), max_context=16).prefill(ids, return_all=True)
    np.testing.assert_array_equal(direct, imported)  # the same bf16 values, the same float32 math
