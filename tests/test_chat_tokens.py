"""Incremental chat tokenization (engine/chat_tokens.py) gives exactly the ids of tokenizing the whole text."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from engine.chat_tokens import IncrementalEncoder, shared_length
from engine.llm import DEFAULT_MODEL
from tests.test_tokenizer import build_sentencepiece, build_tokenizer_json

PIECES = ["hello", " world", "  two  spaces", "naïve café", "数字 123 4567", "\n\n", "\t", "emoji 🎉!", " ",
          "<|im_end|>", "<|im_start|>user", "end.", "don't", "x" * 40, "▁under", "  ", "é"]


def _conversation_texts(rng: random.Random, turns: int) -> list[str]:
    """The rendered prompt before each turn of a ChatML-style conversation, plus edits that are not
    continuations (a changed earlier message, a shorter history)."""
    history, texts = "", []
    for _ in range(turns):
        user = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 6)))
        history += f"<|im_start|>user\n{user}<|im_end|>\n"
        texts.append(history + "<|im_start|>assistant\n")
        reply = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 8)))
        history += f"<|im_start|>assistant\n{reply}<|im_end|>\n"
    edited = texts[-1].replace("<|im_start|>user\n", "<|im_start|>user\nedit ", 1)
    return [*texts, edited, texts[len(texts) // 2], texts[-1][:-3], texts[-1]]


def _with_chat_tokens(tok: HFTokenizer) -> HFTokenizer:
    tok.add_special_tokens([AddedToken("<|im_start|>", normalized=False, special=True),
                            AddedToken("<|im_end|>", normalized=False, special=True)])
    return tok


def _tokenizers(tmp_path: Path) -> dict[str, HFTokenizer]:
    toks = {kind: _with_chat_tokens(build_sentencepiece(kind)) for kind in ("bpe-metaspace", "bpe-llama2",
                                                                             "unigram-metaspace")}
    toks["byte-level"] = _with_chat_tokens(build_tokenizer_json(tmp_path / "bl.json", bos_post_processor=False))
    if (DEFAULT_MODEL / "tokenizer.json").is_file():
        toks["smollm2"] = HFTokenizer.from_file(str(DEFAULT_MODEL / "tokenizer.json"))
    return toks


def test_incremental_ids_equal_whole_text_ids(tmp_path):
    rng = random.Random(1234)
    for name, tok in _tokenizers(tmp_path).items():
        enc = IncrementalEncoder(tok)
        for _ in range(4):
            for text in _conversation_texts(rng, 6):
                assert enc.encode(text) == tok.encode(text, add_special_tokens=False).ids, (name, text)


def test_which_tokenizers_are_cut_at_special_tokens(tmp_path):
    toks = _tokenizers(tmp_path)
    exact = {name: IncrementalEncoder(tok).exact for name, tok in toks.items()}
    # only byte-level pre-tokenizers are cut; sentencepiece's Metaspace places a piece by its offset
    assert exact == {**{k: False for k in ("bpe-metaspace", "bpe-llama2", "unigram-metaspace")}, "byte-level": True,
                     **({"smollm2": True} if "smollm2" in exact else {})}
    if "smollm2" in exact:
        assert exact["smollm2"] is True


def test_a_continued_conversation_tokenizes_only_its_new_text(tmp_path):
    tok = _tokenizers(tmp_path)["byte-level"]
    seen: list[str] = []

    class Recording:
        def to_str(self):
            return tok.to_str()

        def encode(self, text, add_special_tokens):
            seen.append(text)
            return tok.encode(text, add_special_tokens=add_special_tokens)

    enc = IncrementalEncoder(Recording())
    texts = _conversation_texts(random.Random(7), 5)[:5]
    for text in texts:
        enc.encode(text)
    assert seen[0] == texts[0]
    for prev, text, part in zip(texts, texts[1:], seen[1:], strict=False):
        # the previous prompt ends in "<|im_start|>assistant\n", which the next one repeats: everything
        # up to that special token is reused, the rest is tokenized
        reused = prev.rindex("<|im_start|>") + len("<|im_start|>")
        assert part == text[reused:], (part, text)


@pytest.mark.parametrize("a,b", [("", ""), ("abc", ""), ("abc", "abd"), ("abc", "abcdef"), ("same", "same"),
                                 ("xyz", "abc"), ("naïve café", "naïve cafe")])
def test_shared_length(a, b):
    assert shared_length(a, b) == len(os.path.commonprefix([a, b]))
