"""Generation stopping end to end, on the numpy backend: EOS, stop strings, the token budget and the
context limit, through LLM.generate and through the CLI, against greedy tokens of the reference model."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from engine.config import ModelConfig
from engine.llm import LLM
from engine.sampling import SamplingParams
from engine.tokenizer import Tokenizer
from tests.test_cli import gdecode, reference_greedy
from tests.tiny import make_tiny_model

PROMPT = "hello world"
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=40)
NEWLINE = "\u010a"  # the byte-level token of "\n"


def _steer_to_newlines(d: Path) -> None:
    """Give the newline token the lm_head row of the most frequent greedy token, scaled up, so that
    greedy output holds newlines (and the `--stop '\\n'` test has one to stop at)."""
    from safetensors.numpy import load_file, save_file

    ref = reference_greedy(d, PROMPT, 40)
    common = np.bincount(ref).argmax()
    nl = Tokenizer.from_dir(d)._tok.token_to_id(NEWLINE)
    t = load_file(d / "model.safetensors")
    t["lm_head.weight"][nl] = 1.5 * t["lm_head.weight"][common]
    save_file(t, d / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = make_tiny_model(tmp_path_factory.mktemp("stop") / "m", "llama", tied=False, heads=4, kv_heads=2,
                        vocab=300, seed=3)
    _steer_to_newlines(d)
    return d


@pytest.fixture(scope="module")
def ref(model):
    return reference_greedy(model, PROMPT, 40)


@pytest.fixture(scope="module")
def tok(model):
    return Tokenizer.from_dir(model, ModelConfig.from_dir(model))


def _with_eos(src: Path, dst: Path, eos: int) -> Path:
    shutil.copytree(src, dst)
    (dst / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return dst


def _first_new(ref: list[int], start: int, avoid: set[int]) -> int:
    """Index of the first token at or after start that appears nowhere before it, nor in avoid."""
    return next(k for k in range(start, len(ref)) if ref[k] not in ref[:k] and ref[k] not in avoid)


def test_reference_output_has_newlines(ref, tok):
    text = tok.decode(ref)
    assert "\n" in text and text.index("\n") > 0  # the premise of the stop tests below


def test_max_new_tokens(model, ref, tok):
    llm = LLM(model, backend="numpy")
    n = 17
    text = "".join(llm.generate(PROMPT, SamplingParams(temperature=0.0, max_new_tokens=n)))
    assert llm.stats.stop_reason == "length"
    assert llm.stats.new_tokens == n
    assert text == tok.decode(ref[:n])


def test_eos_stops_generation(model, ref, tok, tmp_path):
    k = _first_new(ref, 5, tok.eos_ids)
    llm = LLM(_with_eos(model, tmp_path / "m", ref[k]), backend="numpy")
    text = "".join(llm.generate(PROMPT, GREEDY))
    assert llm.stats.stop_reason == "eos"
    assert llm.stats.new_tokens == k + 1  # the EOS token is generated, not shown
    assert text == tok.decode(ref[:k])


def test_stop_string(model, ref, tok):
    full = tok.decode(ref)
    at = next(i for i in range(6, len(full) - 3) if full.find(full[i:i + 3]) == i)
    stop = full[at:at + 3]
    llm = LLM(model, backend="numpy")
    text = "".join(llm.generate(PROMPT, SamplingParams(temperature=0.0, max_new_tokens=40, stop=(stop,))))
    assert llm.stats.stop_reason == "stop"
    assert text == full[:at]


def test_context_limit(model, ref, tok):
    llm = LLM(model, backend="numpy", max_context=16)
    n_prompt = len(tok.encode(PROMPT))
    text = "".join(llm.generate(PROMPT, GREEDY))
    assert llm.stats.stop_reason == "context"
    assert llm.stats.new_tokens == 16 - n_prompt
    assert text == tok.decode(ref[:16 - n_prompt])


def _cli(model, *args, stdin=None, prompt=PROMPT):
    return gdecode("generate", prompt, "--model", model, "--backend", "numpy", "--temperature", "0", *args,
                   stdin=stdin)


def _stop_of(r):
    return r.stderr.rsplit("(stop: ", 1)[1].split(")")[0]


def test_cli_output_equals_reference(model, ref, tok):
    r = _cli(model, "-n", "24")
    assert r.returncode == 0, r.stderr
    assert r.stdout == tok.decode(ref[:24]) + "\n"
    assert _stop_of(r) == "length"


def test_cli_prompt_from_stdin(model, ref, tok):
    r = _cli(model, "-n", "24", prompt="-", stdin=PROMPT)
    assert r.returncode == 0, r.stderr
    assert r.stdout == tok.decode(ref[:24]) + "\n"


def test_cli_stop_escape_newline(model, ref, tok):
    full = tok.decode(ref)
    r = _cli(model, "-n", "40", "--stop", "\\n")  # as typed in a shell: a backslash and an n
    assert r.returncode == 0, r.stderr
    assert r.stdout == full[:full.index("\n")] + "\n"
    assert _stop_of(r) == "stop"


def test_cli_stop_string_and_stdin(model, ref, tok):
    full = tok.decode(ref)
    at = next(i for i in range(4, len(full) - 2) if full[i] != "\n" and full.find(full[i:i + 2]) == i)
    r = _cli(model, "-n", "40", "--stop", "zzz-never", "--stop", full[at:at + 2], prompt="-", stdin=PROMPT)
    assert r.returncode == 0, r.stderr
    assert r.stdout == full[:at] + "\n"
    assert _stop_of(r) == "stop"


def test_cli_eos(model, ref, tok, tmp_path):
    k = _first_new(ref, 5, tok.eos_ids)
    r = _cli(_with_eos(model, tmp_path / "m", ref[k]), "-n", "40")
    assert r.returncode == 0, r.stderr
    assert r.stdout == tok.decode(ref[:k]) + "\n"
    assert _stop_of(r) == "eos"
    assert f"generated {k + 1} tokens" in r.stderr


def test_cli_context_limit(model, ref, tok):
    n_prompt = len(tok.encode(PROMPT))
    r = _cli(model, "-n", "40", "--max-context", "12")
    assert r.returncode == 0, r.stderr
    assert r.stdout == tok.decode(ref[:12 - n_prompt]) + "\n"
    assert _stop_of(r) == "context" and "context limit of 12" in r.stderr
