"""The command line as a newcomer and a hostile user meet it: help, version, bad arguments, bad bytes,
huge input, closed pipes, Ctrl-C, context limits and non-finite logits, each ending cleanly."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest

from engine.llm import DEFAULT_MODEL, DEFAULT_MODEL_NAME
from engine.tokenizer import Tokenizer
from tests.test_cli import ROOT, assert_one_line_error, gdecode, reference_greedy
from tests.tiny import make_tiny_model

COMMANDS = ["generate", "chat", "info", "import-gguf", "kernels", "bench", "serve"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("hard") / "m", "llama", tied=False, heads=4, kv_heads=2,
                           vocab=300, seed=5)


def _copy(src: Path, dst: Path, config: dict | None = None, tokenizer_config: dict | None = None) -> Path:
    shutil.copytree(src, dst)
    for name, edit in (("config.json", config), ("tokenizer_config.json", tokenizer_config)):
        if edit:
            d = json.loads((dst / name).read_text())
            d.update(edit)
            (dst / name).write_text(json.dumps(d))
    return dst


def _gen(model, *args, stdin=None):
    return gdecode("generate", *args, "--model", model, "--backend", "numpy", stdin=stdin)


# --- help and version -------------------------------------------------------------------------------

def test_no_arguments_prints_help_and_exits_2():
    r = gdecode()
    assert r.returncode == 2
    assert "Usage: gdecode" in r.stderr and "generate" in r.stderr
    assert "error" not in r.stderr.lower() and "Traceback" not in r.stderr


@pytest.mark.parametrize("args", [["-h"], ["--help"], *[[c, "-h"] for c in COMMANDS]])
def test_help_everywhere(args):
    r = gdecode(*args)
    assert r.returncode == 0, r.stderr
    assert "Usage: gdecode" in r.stdout and r.stderr == ""


def test_version():
    r = gdecode("--version")
    assert r.returncode == 0
    assert r.stdout.strip() == f"gdecode {metadata.version('gdecode')}"


@pytest.mark.parametrize("command", COMMANDS)
def test_help_has_no_type_artefacts_and_short_default_model(command):
    out = gdecode(command, "--help").stdout
    assert "<bool>" not in out and "<list[" not in out
    assert str(DEFAULT_MODEL.parent) not in out.replace("│", "").replace("\n", "")
    if "--model" in out and command != "bench":
        assert DEFAULT_MODEL_NAME in out


def test_every_option_has_a_description():
    from cli.main import build

    root = build()
    for name, cmd in root.commands.items():
        for p in cmd.params:
            assert (p.help or "").strip(), f"{name} {p.name} has no help"


# --- --stop escapes --------------------------------------------------------------------------------

@pytest.mark.parametrize("typed, meant", [("\\n\\n", "\n\n"), ("a\\tb", "a\tb"), ("\\\\n", "\\n"), ("x\\qy", "x\\qy"),
                                          ("\\x41\\u00e9", "Aé"), ("plain", "plain")])
def test_unescape(typed, meant):
    from cli.generate import unescape

    assert unescape(typed) == meant


# --- bad bytes, huge input --------------------------------------------------------------------------

def test_invalid_utf8_on_stdin_is_replaced(tiny):
    bad = _gen(tiny, "-", "--temperature", "0", "-n", "8", stdin=b"hello \xff\xfe world")
    good = _gen(tiny, "hello \ufffd\ufffd world", "--temperature", "0", "-n", "8")
    assert bad.returncode == 0 and good.returncode == 0, bad.stderr
    assert bad.stdout == good.stdout
    assert "not valid UTF-8" in bad.stderr and "Traceback" not in bad.stderr


def test_invalid_utf8_in_arguments_is_replaced(tiny):
    arg = os.fsdecode(b"hello \xff world")  # what Python makes of the bytes a shell passes
    bad = _gen(tiny, arg, "--temperature", "0", "-n", "8", "--stop", os.fsdecode(b"zz\xfe"))
    good = _gen(tiny, "hello \ufffd world", "--temperature", "0", "-n", "8")
    assert bad.returncode == 0, bad.stderr
    assert bad.stdout == good.stdout
    assert bad.stderr.count("not valid UTF-8") == 2 and "Traceback" not in bad.stderr


def test_huge_prompt_on_stdin_is_refused(tiny):
    r = _gen(tiny, "-", stdin=b"word " * 4_200_000)  # 21 MB
    assert_one_line_error(r, "standard input", "bytes")


def test_huge_prompt_argument_is_refused(tiny):
    r = _gen(tiny, "wörd " * 20_000)  # 120 kB, under the kernel's limit on one argument
    assert_one_line_error(r, "bytes", "context")


# --- context limits ---------------------------------------------------------------------------------

@pytest.mark.parametrize("ctx", ["513", "1000000000000"])
def test_max_context_above_the_model_limit(tiny, ctx):
    assert_one_line_error(_gen(tiny, "hi", "--max-context", ctx), f"--max-context {ctx}", "limit of 512")


def test_numpy_kv_cache_larger_than_memory(tiny, tmp_path):
    d = _copy(tiny, tmp_path / "m", config={"max_position_embeddings": 2_000_000_000})
    r = _gen(d, "hi", "--max-context", "2000000000")
    assert_one_line_error(r, "KV cache", "GiB", "--max-context")


# --- NaN and Inf in the logits ----------------------------------------------------------------------

def _poison(src: Path, dst: Path, name: str, row: int, value: float) -> Path:
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    t = load_file(dst / "model.safetensors")
    t[name][row, :3] = value
    save_file(t, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weight_stops_at_step_0(tiny, tmp_path, value):
    d = _poison(tiny, tmp_path / "m", "model.layers.0.mlp.down_proj.weight", 5, value)
    for temp in ("0", "0.8"):
        r = _gen(d, "hello world", "--temperature", temp, "--seed", "1")
        assert_one_line_error(r, "step 0", "numpy", "NaN or Inf")


def test_non_finite_logits_end_chat_with_one_line(tiny, tmp_path):
    d = _poison(tiny, tmp_path / "m", "model.layers.0.mlp.down_proj.weight", 5, float("nan"))
    r = gdecode("chat", "--model", d, "--backend", "numpy", stdin="hello world\n")
    assert_one_line_error(r, "step 0", "numpy", "NaN or Inf")


def test_non_finite_logits_name_the_step(tiny, tmp_path):
    tok = Tokenizer.from_dir(tiny)
    ref = reference_greedy(tiny, "hello world", 20)
    prompt = set(tok.encode("hello world"))
    k = next(i for i in range(2, 20) if ref[i] not in prompt and ref[i] not in ref[:i])
    d = _poison(tiny, tmp_path / "m", "model.embed_tokens.weight", ref[k], float("nan"))
    r = _gen(d, "hello world", "--temperature", "0", "-n", "20")
    assert_one_line_error(r, f"step {k + 1} ", "numpy")
    assert r.stdout == tok.decode(ref[:k + 1])  # the text before it is kept


# --- closed pipes and Ctrl-C ------------------------------------------------------------------------

def _spawn(model, *args, **kw):
    code = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); from cli.main import main; main()"
    cmd = [sys.executable, "-c", code, "generate", *args, "--model", str(model), "--backend", "numpy"]
    return subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, **kw)


def test_stdout_closed_early_exits_0_quietly(tiny):
    p = _spawn(tiny, "hello world", "-n", "400", "--temperature", "0", stderr=subprocess.PIPE)
    assert len(p.stdout.read(10)) == 10  # as `| head -c 10` does
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 0
    assert "Traceback" not in err and "rror" not in err and "(stop: closed)" in err


def test_stdout_and_stderr_closed_early_exit_0(tiny):
    p = _spawn(tiny, "hello world", "-n", "400", "--temperature", "0", stderr=subprocess.STDOUT)
    assert len(p.stdout.read(10)) == 10  # `2>&1 | head -c 10`
    p.stdout.close()
    assert p.wait(timeout=120) == 0


def test_help_into_a_closed_pipe_exits_0():
    r = subprocess.run(f"{sys.executable} -c 'from cli.main import main; main()' generate --help | head -c 10",
                       shell=True, cwd=ROOT, capture_output=True, text=True, timeout=120,
                       executable="/bin/bash", env={**os.environ, "SHELLOPTS": "pipefail"})
    assert r.returncode == 0 and r.stderr == ""


@pytest.fixture(scope="module")
def slow_model(tmp_path_factory):
    """Big enough that a few thousand tokens take seconds on numpy, with room for them in the context."""
    d = make_tiny_model(tmp_path_factory.mktemp("slow") / "m", "llama", tied=False, heads=8, kv_heads=2,
                        hidden=512, head_dim=64, intermediate=1536, layers=4, vocab=300, seed=9)
    cfg = json.loads((d / "config.json").read_text())
    cfg["max_position_embeddings"] = 8192
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_ctrl_c_prints_stats_and_exits_130(slow_model):
    p = _spawn(slow_model, "hello world", "-n", "8000", "--temperature", "0.8", "--seed", "3",
               stderr=subprocess.PIPE)
    first = p.stdout.read(1)  # generation has started
    p.send_signal(signal.SIGINT)
    out = first + p.stdout.read()
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 130, err
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines[-1] == "interrupted"
    stats = re.search(r"generated (\d+) tokens .*\(stop: interrupted\)", lines[-2])
    assert stats and 0 < int(stats.group(1)) < 8000
    assert out.endswith(b"\n")


# --- bad inputs, each one line ----------------------------------------------------------------------

BAD = {
    "negative temperature": (["x", "--temperature", "-1"], "--temperature must be"),
    "nan temperature": (["x", "--temperature", "nan"], "--temperature must be"),
    "top-p zero": (["x", "--top-p", "0"], "--top-p"),
    "top-p above one": (["x", "--top-p", "1.5"], "--top-p"),
    "negative top-k": (["x", "--top-k", "-1"], "--top-k"),
    "zero new tokens": (["x", "--max-new-tokens", "0"], "--max-new-tokens"),
    "negative seed": (["x", "--seed", "-1"], "--seed"),
    "huge seed": (["x", "--seed", str(2**64)], "--seed"),
    "not a number": (["x", "-n", "abc"], "--max-new-tokens"),
    "empty stop": (["x", "--stop", ""], "--stop must be"),
    "unknown backend": (["x", "--backend", "tpu"], "tpu"),
    "max-context 1": (["x", "--max-context", "1"], "--max-context"),
    "negative max-context": (["x", "--max-context", "-5"], "--max-context"),
    "system without chat": (["x", "--system", "be nice"], "--system"),
    "empty prompt": ([""], "empty"),
    "empty stdin": (["-"], "empty"),
    "unknown option": (["x", "--bogus"], "--bogus"),
    "missing prompt": ([], "prompt"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_generate_arguments(tiny, name):
    args, needle = BAD[name]
    assert_one_line_error(gdecode("generate", "--model", tiny, "--backend", "numpy", *args, stdin=b""), needle)


def test_unknown_command():
    assert_one_line_error(gdecode("generat"), "generat")


def test_model_path_is_a_file(tiny):
    assert_one_line_error(_gen(tiny / "config.json", "x"), "config.json")


def test_model_without_chat_template(tiny, tmp_path):
    d = _copy(tiny, tmp_path / "m", tokenizer_config={"chat_template": None})
    assert_one_line_error(_gen(d, "x", "--chat"), "no chat template")


@pytest.mark.parametrize("template, needle", [
    ("{% include 'x.jinja' %}", "include"),
    ("{% import 'x.jinja' as x %}", "import"),
    ("{% set r = range(100000) %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}", "longer than"),
    ("{% set ns = namespace(s='a') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "bound"),
    ("{{ 1 + 'a' }}", "TypeError"),
])
def test_hostile_chat_template_through_the_cli(tiny, tmp_path, template, needle):
    d = _copy(tiny, tmp_path / "m", tokenizer_config={"chat_template": template})
    assert_one_line_error(_gen(d, "x", "--chat"), "chat template", needle)


def test_generate_from_stdin_with_chat(tiny):
    r = _gen(tiny, "-", "--chat", "--temperature", "0", "-n", "4", stdin=b"hello")
    assert r.returncode == 0, r.stderr
    assert np.isfinite(float(re.search(r"prompt (\d+) tokens", r.stderr).group(1)))
