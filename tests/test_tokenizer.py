import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

from engine.config import ModelConfig
from engine.errors import GDecodeError
from engine.tokenizer import StreamDecoder, Tokenizer

SPECIALS = ["<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog",
    "café crème brûlée, naïve façade",
    "日本語のテキストです",
    "hello hello world world",
]
CHATML = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}"
    "{% endif %}\n"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}\n"
    "{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}"
)
STRINGS = [
    "hello world",
    "café crème 😀 brûlée",
    "日本語のテキスト👍🏽!",
    "🇯🇵🇫🇷 flags, 👨‍👩‍👧 family",
    "a\u0301 combining, Ω≈ç√∫ and 𝄞 music",
    "trailing emoji 🎉",
]


def build_tokenizer_json(path: Path, bos_post_processor: bool) -> HFTokenizer:
    """A small byte-level BPE tokenizer; emoji stay split across several byte tokens."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 3, trainer)
    if bos_post_processor:
        bos = ("<|bos|>", tok.token_to_id("<|bos|>"))
        tok.post_processor = processors.TemplateProcessing(
            single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[bos]
        )
    tok.save(str(path))
    return tok


def make_tokenizer_dir(
    tmp_path: Path,
    bos_post_processor: bool = True,
    config: dict | None = None,
    generation: dict | None = None,
    name: str = "tok",
) -> Path:
    d = tmp_path / name
    d.mkdir()
    build_tokenizer_json(d / "tokenizer.json", bos_post_processor)
    base = {
        "bos_token": "<|bos|>",
        "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": True},
        "chat_template": CHATML,
    }
    (d / "tokenizer_config.json").write_text(json.dumps({**base, **(config or {})}))
    if generation is not None:
        (d / "generation_config.json").write_text(json.dumps(generation))
    return d


@pytest.fixture
def tok(tmp_path) -> Tokenizer:
    return Tokenizer.from_dir(make_tokenizer_dir(tmp_path))


def test_emoji_are_split_across_tokens(tok):
    assert len(tok.encode("😀", add_special_tokens=False)) > 1


@pytest.mark.parametrize("text", STRINGS)
def test_roundtrip(tok, text):
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


@pytest.mark.parametrize("text", STRINGS)
def test_stream_matches_full_decode(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    dec = StreamDecoder(tok)
    pieces = [dec.push(i) for i in ids]
    tail = dec.flush()
    assert "".join(pieces) + tail == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)
    if any(ord(c) > 0xFFFF for c in text):
        assert "" in pieces  # something was held back


def test_stream_each_prefix_is_final(tok):
    text = STRINGS[3]
    ids = tok.encode(text, add_special_tokens=False)
    dec, out = StreamDecoder(tok), ""
    for i in ids:
        out += dec.push(i)
        assert text.startswith(out)
    assert out + dec.flush() == text


def test_stream_flush_releases_incomplete_character(tok):
    ids = tok.encode("ok 😀", add_special_tokens=False)
    dec = StreamDecoder(tok)
    out = "".join(dec.push(i) for i in ids[:-1])
    assert out == "ok "
    assert dec.flush() == tok.decode(ids[:-1])[len(out) :]
    assert dec.flush() == ""


def test_stream_special_tokens(tok):
    end = tok._tok.token_to_id("<|im_end|>")
    ids = tok.encode("héllo", add_special_tokens=False) + [end] + tok.encode(" 👍", add_special_tokens=False)
    for skip in (True, False):
        dec = StreamDecoder(tok, skip_special_tokens=skip)
        text = "".join(dec.push(i) for i in ids) + dec.flush()
        assert text == tok.decode(ids, skip_special_tokens=skip)
    assert "<|im_end|>" not in tok.decode(ids)


def test_bos_from_post_processor(tmp_path):
    t = Tokenizer.from_dir(make_tokenizer_dir(tmp_path))
    bos = t.bos_id
    assert bos == t._tok.token_to_id("<|bos|>")
    ids = t.encode("hello")
    assert ids[0] == bos and ids.count(bos) == 1
    assert t.encode("hello", add_special_tokens=False) == ids[1:]


def test_no_bos_without_post_processor(tmp_path):
    t = Tokenizer.from_dir(make_tokenizer_dir(tmp_path, bos_post_processor=False))
    assert t.encode("hello") == t.encode("hello", add_special_tokens=False)
    assert t.bos_id not in t.encode("hello")


def test_add_bos_token_true_adds_bos(tmp_path):
    t = Tokenizer.from_dir(make_tokenizer_dir(tmp_path, bos_post_processor=False, config={"add_bos_token": True}))
    assert t.encode("hello") == [t.bos_id, *t.encode("hello", add_special_tokens=False)]


def test_add_bos_token_false_drops_bos(tmp_path):
    t = Tokenizer.from_dir(make_tokenizer_dir(tmp_path, config={"add_bos_token": False}))
    assert t.encode("hello") == t.encode("hello", add_special_tokens=False)


def test_eos_ids_union(tmp_path):
    d = make_tokenizer_dir(tmp_path, generation={"eos_token_id": [1, 7]})
    cfg = ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 300,
            "hidden_size": 8,
            "intermediate_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "eos_token_id": 9,
            "bos_token_id": 0,
        }
    )
    t = Tokenizer.from_dir(d, cfg)
    assert t.eos_ids == {1, 7, 9, t._tok.token_to_id("<|im_end|>")}
    assert Tokenizer.from_dir(d).eos_ids == {1, 7, 3}


def test_bos_id_falls_back_to_config(tmp_path):
    d = make_tokenizer_dir(tmp_path, bos_post_processor=False, config={"bos_token": None})
    cfg = ModelConfig.from_dict(
        {
            "architectures": ["Qwen2ForCausalLM"],
            "vocab_size": 300,
            "hidden_size": 8,
            "intermediate_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "bos_token_id": 2,
        }
    )
    assert Tokenizer.from_dir(d).bos_id is None
    assert Tokenizer.from_dir(d, cfg).bos_id == 2


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 😀"}]
RENDERED = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 😀<|im_end|>\n"


def test_chat_template(tok):
    assert tok.apply_chat_template(MESSAGES) == RENDERED + "<|im_start|>assistant\n"
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=False) == RENDERED


def test_chat_template_raise_exception(tok):
    with pytest.raises(GDecodeError, match="unknown role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_chat_template_list_form(tmp_path):
    named = [{"name": "tool_use", "template": "wrong"}, {"name": "default", "template": CHATML}]
    t = Tokenizer.from_dir(make_tokenizer_dir(tmp_path, config={"chat_template": named}))
    assert t.apply_chat_template(MESSAGES, add_generation_prompt=False) == RENDERED


def test_chat_template_jinja_file_and_variables(tmp_path):
    d = make_tokenizer_dir(tmp_path, config={"chat_template": None})
    (d / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}{{ m['content'] | tojson }}{{ eos_token }}{% endfor %}"
    )
    t = Tokenizer.from_dir(d)
    assert t.apply_chat_template(MESSAGES) == '<|bos|>"Be brief."<|im_end|>"Hi 😀"<|im_end|>'


def test_chat_template_missing(tmp_path):
    t = Tokenizer.from_dir(make_tokenizer_dir(tmp_path, config={"chat_template": None}))
    with pytest.raises(GDecodeError, match="no chat template"):
        t.apply_chat_template(MESSAGES)


def test_chat_template_is_sandboxed(tmp_path):
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    t = Tokenizer.from_dir(make_tokenizer_dir(tmp_path, config={"chat_template": evil}))
    with pytest.raises(GDecodeError):
        t.apply_chat_template(MESSAGES)


def test_encode_chat_has_one_bos(tmp_path):
    d = make_tokenizer_dir(tmp_path, config={"chat_template": "{{ bos_token }}{{ messages[0]['content'] }}"})
    t = Tokenizer.from_dir(d)
    ids = t.encode_chat(MESSAGES[:1])
    assert ids.count(t.bos_id) == 1 and ids[0] == t.bos_id


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(GDecodeError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_corrupt_tokenizer_json(tmp_path):
    d = make_tokenizer_dir(tmp_path)
    (d / "tokenizer.json").write_text('{"model": 3}')
    with pytest.raises(GDecodeError, match="tokenizer.json"):
        Tokenizer.from_dir(d)


@pytest.mark.slow
@pytest.mark.parametrize("bos_post_processor", [True, False])
def test_matches_transformers(tmp_path, bos_post_processor):
    transformers = pytest.importorskip("transformers")
    d = make_tokenizer_dir(tmp_path, bos_post_processor, config={"tokenizer_class": "PreTrainedTokenizerFast"})
    hf, t = transformers.AutoTokenizer.from_pretrained(str(d)), Tokenizer.from_dir(d)
    for text in STRINGS:
        assert t.encode(text) == hf.encode(text)
        ids = hf.encode(text, add_special_tokens=False)
        assert t.decode(ids, skip_special_tokens=False) == hf.decode(ids)
    for gen in (True, False):
        want = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen)
        assert t.apply_chat_template(MESSAGES, add_generation_prompt=gen) == want


# sentencepiece-style tokenizers: "▁" marks a space; a token decoded alone loses it
SP_CORPUS = CORPUS + ["the lazy dog sleeps", "brown fox, quick fox"]
LLAMA_DECODER = decoders.Sequence(
    [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
)


def _with_byte_tokens(tok: HFTokenizer) -> HFTokenizer:
    """Add sentencepiece's <0xHH> tokens to the vocabulary and turn byte fallback on."""
    d = json.loads(tok.to_str())
    vocab = d["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    d["model"]["byte_fallback"] = True
    return HFTokenizer.from_str(json.dumps(d))


def build_sentencepiece(kind: str) -> HFTokenizer:
    if kind == "unigram-metaspace":
        tok = HFTokenizer(models.Unigram())
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.UnigramTrainer(vocab_size=220, special_tokens=["<unk>", "<s>", "</s>"], unk_token="<unk>",
                                          show_progress=False)
        tok.train_from_iterator(SP_CORPUS * 4, trainer)
        return tok
    tok = HFTokenizer(models.BPE(unk_token="<unk>"))
    if kind == "bpe-metaspace":  # Mistral / Llama as transformers converts them today
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    else:  # "bpe-llama2": the older normalizer form
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = LLAMA_DECODER
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(SP_CORPUS * 4, trainer)
    return _with_byte_tokens(tok)


SP_KINDS = ["bpe-metaspace", "bpe-llama2", "unigram-metaspace"]
SP_STRINGS = ["hello world the quick brown fox", "the  lazy dog, naïve café", *STRINGS]


@pytest.fixture(params=SP_KINDS)
def sp_tok(request, tmp_path) -> Tokenizer:
    d = tmp_path / request.param
    d.mkdir()
    build_sentencepiece(request.param).save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return Tokenizer.from_dir(d)


def _stream(tok, ids, context=()):
    dec = StreamDecoder(tok, context=context)
    pieces = [dec.push(i) for i in ids]
    return pieces, dec.flush()


def test_sentencepiece_token_alone_loses_its_space(sp_tok):
    ids = sp_tok.encode("hello world the fox", add_special_tokens=False)
    alone = "".join(sp_tok.decode([i]) for i in ids)
    assert "helloworld" in alone.replace(" ", "") and alone != sp_tok.decode(ids)  # what the stream must avoid


@pytest.mark.parametrize("text", SP_STRINGS)
def test_sentencepiece_stream_matches_full_decode(sp_tok, text):
    ids = sp_tok.encode(text, add_special_tokens=False)
    pieces, tail = _stream(sp_tok, ids)
    full = sp_tok.decode(ids)
    assert "".join(pieces) + tail == full
    if "unigram" not in sp_tok.source:  # byte fallback: every character survives
        assert full == text
    if text.startswith("hello world"):
        assert "".join(pieces).startswith("hello world")  # words not joined


@pytest.mark.parametrize("text", SP_STRINGS[:3])
def test_sentencepiece_stream_after_prompt_keeps_the_space(sp_tok, text):
    prompt = sp_tok.encode("the quick", add_special_tokens=False)
    ids = sp_tok.encode("the quick " + text, add_special_tokens=False)[len(prompt):]
    pieces, tail = _stream(sp_tok, ids, context=prompt)
    whole = sp_tok.decode(prompt + ids)
    assert "".join(pieces) + tail == whole[len(sp_tok.decode(prompt)):]
    assert ("".join(pieces) + tail).startswith(" ")


def test_stream_with_context_returns_only_new_text(tok):
    prompt = tok.encode("hello ", add_special_tokens=False)
    ids = tok.encode("café 😀 world", add_special_tokens=False)
    pieces, tail = _stream(tok, ids, context=prompt)
    assert "".join(pieces) + tail == "café 😀 world"
