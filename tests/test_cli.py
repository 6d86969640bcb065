"""The command line as a user meets it: streaming output, stats, and one-line errors."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.config import ModelConfig
from engine.llm import StopMatcher
from engine.reference import ReferenceModel
from engine.tokenizer import Tokenizer
from engine.weights import load_weights
from tests.tiny import make_tiny_model

ROOT = Path(__file__).resolve().parent.parent


def gdecode(*args, stdin: str | bytes | None = None) -> subprocess.CompletedProcess:
    """Run the CLI; stdout and stderr come back as text and must be valid UTF-8."""
    cmd = [sys.executable, "-c", "from cli.main import main; main()", *map(str, args)]
    data = stdin.encode() if isinstance(stdin, str) else stdin
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, input=data, timeout=300)
    return subprocess.CompletedProcess(cmd, r.returncode, r.stdout.decode(), r.stderr.decode())


def reference_greedy(model_dir: Path, prompt: str, n: int) -> list[int]:
    """n greedy tokens of the numpy reference model after prompt, ignoring EOS."""
    cfg = ModelConfig.from_dir(model_dir)
    tok = Tokenizer.from_dir(model_dir, cfg)
    m = ReferenceModel(cfg, load_weights(model_dir, cfg), cfg.max_position_embeddings)
    logits, out = m.prefill(tok.encode(prompt)), []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = m.decode(out[-1])
    return out


def assert_one_line_error(r, *needles):
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("no CUDA GPU")]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: ")
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("cli") / "m", "llama", tied=False, heads=4, kv_heads=2)


def test_generate_streams_text_and_stats(tiny):
    r = gdecode("generate", "hello world", "--model", tiny, "--backend", "numpy",
                "--temperature", "0", "--max-new-tokens", "5")
    assert r.returncode == 0, r.stderr
    assert "generated 5 tokens" in r.stderr and "tok/s" in r.stderr and "[numpy]" in r.stderr
    want = Tokenizer.from_dir(tiny).decode(reference_greedy(tiny, "hello world", 5))
    assert r.stdout == want + "\n"


def test_generate_seed_is_reproducible(tiny):
    args = ("generate", "abc", "--model", tiny, "--backend", "numpy", "--max-new-tokens", "12",
            "--temperature", "1.0", "--top-k", "0", "--top-p", "1.0", "--seed")
    a, b, c = gdecode(*args, 11), gdecode(*args, 11), gdecode(*args, 12)
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout
    assert a.stdout != c.stdout


def assert_stops_at_context_limit(model, backend: str, prompt: str, ctx: int):
    """generate with a KV cache of ctx tokens runs into its end, finishes and says so."""
    r = gdecode("generate", prompt, "--model", model, "--backend", backend, "--temperature", "0",
                "--max-context", ctx, "--max-new-tokens", "100")
    assert r.returncode == 0, r.stderr
    assert f"context limit of {ctx}" in r.stderr


def test_generate_stops_at_context_limit(tiny):
    assert_stops_at_context_limit(tiny, "numpy", "a b", 16)


def test_prompt_longer_than_context(tiny):
    r = gdecode("generate", "word " * 40, "--model", tiny, "--backend", "numpy", "--max-context", "8")
    assert_one_line_error(r, "context")


def test_info(tiny):
    r = gdecode("info", "--model", tiny)
    assert r.returncode == 0, r.stderr
    cfg = json.loads((tiny / "config.json").read_text())
    assert "llama" in r.stdout
    assert f"{cfg['num_hidden_layers']} layers" in r.stdout
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 2
    assert f"{kv:,}" in r.stdout


def test_missing_model_dir(tmp_path):
    assert_one_line_error(gdecode("generate", "x", "--model", tmp_path / "nope", "--backend", "numpy"), "not found")


def test_missing_config(tmp_path):
    assert_one_line_error(gdecode("info", "--model", tmp_path), "config.json")


def test_unsupported_architecture(tmp_path, tiny):
    d = tmp_path / "m"
    d.mkdir()
    cfg = json.loads((tiny / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(gdecode("info", "--model", d), "GPT2LMHeadModel", "LlamaForCausalLM")


def test_bad_option_is_one_line():
    assert_one_line_error(gdecode("generate", "x", "--backend", "numpy", "--bogus"), "--bogus")


def test_bad_backend(tiny):
    assert_one_line_error(gdecode("generate", "x", "--model", tiny, "--backend", "tpu"), "tpu")


def test_truncated_weights(tmp_path, tiny):
    d = tmp_path / "m"
    d.mkdir()
    for f in tiny.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    st = d / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    assert_one_line_error(gdecode("generate", "x", "--model", d, "--backend", "numpy"), "model.safetensors")


@pytest.mark.parametrize(
    "pieces, stops, want, hit",
    [
        (["Hel", "lo wor", "ld"], ("wor",), "Hello ", True),
        (["ab", "c\n", "\nd"], ("\n\n",), "abc", True),
        (["ab", "c"], ("cd",), "abc", False),
        (["x"], (), "x", False),
    ],
)
def test_stop_matcher(pieces, stops, want, hit):
    m = StopMatcher(stops)
    out, got_hit = "", False
    for p in pieces:
        text, got_hit = m.push(p)
        out += text
        if got_hit:
            break
    if not got_hit:
        out += m.push("", final=True)[0]
    assert out == want and got_hit == hit


def _rewrite_checkpoint(src: Path, dst: Path, edit) -> Path:
    from safetensors.numpy import load_file, save_file

    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_missing_tensor(tmp_path, tiny):
    d = _rewrite_checkpoint(tiny, tmp_path / "m", lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    assert_one_line_error(gdecode("generate", "x", "--model", d, "--backend", "numpy"),
                          "model.layers.1.mlp.down_proj.weight", "model.safetensors")


def test_wrong_shape(tmp_path, tiny):
    def edit(t):
        name = "model.layers.0.self_attn.q_proj.weight"
        t[name] = t[name][:-1]

    d = _rewrite_checkpoint(tiny, tmp_path / "m", edit)
    assert_one_line_error(gdecode("info", "--model", d), "model.layers.0.self_attn.q_proj.weight")
