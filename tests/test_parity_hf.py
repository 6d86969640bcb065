"""The numpy reference model against Hugging Face transformers on tiny random checkpoints."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import ModelConfig
from engine.errors import GDecodeError
from engine.reference import ReferenceModel
from engine.weights import load_weights
from tests.tiny import make_tiny_model

STEPS = 32
PROMPT_LEN = 11
MAX_CONTEXT = 64
RTOL = 1e-4
# low-precision checkpoint vs the float32 checkpoint it was rounded from, max|a-b| / max|b|:
# about twice the worst seen on these models (bf16 2.5e-2, fp16 4.2e-3)
LOWP_RTOL = {"bfloat16": 5e-2, "float16": 1e-2}

# arch, tied, heads, kv_heads, llama3 rope scaling
CASES = [
    ("llama", False, 4, 4, True),
    ("llama", True, 8, 2, True),
    ("llama", False, 7, 1, False),
    ("mistral", True, 4, 4, False),
    ("mistral", False, 8, 2, False),
    ("mistral", True, 7, 1, False),
    ("qwen2", True, 4, 4, False),
    ("qwen2", False, 8, 2, False),
    ("qwen2", True, 7, 1, False),
    ("qwen3", False, 4, 4, False),
    ("qwen3", True, 8, 2, False),
    ("qwen3", False, 7, 1, False),
]


def build(root, arch, tied, heads, kv_heads, llama3, dtype="float32"):
    # transformers' LlamaConfig insists on hidden % heads == 0
    hidden = 112 if arch == "llama" and heads == 7 else 64
    name = f"{arch}-{tied}-{heads}-{kv_heads}-{llama3}-{dtype}"
    return make_tiny_model(
        root / name, arch, tied=tied, heads=heads, kv_heads=kv_heads, dtype=dtype, llama3_scaling=llama3,
        hidden=hidden, seed=heads,
    )


def prompt(vocab, seed=0):
    return np.random.default_rng(seed).integers(3, vocab, PROMPT_LEN).tolist()


def reference_run(model_dir, ids, feed=None):
    """Prefill logits for every prompt token, then STEPS decode logits; tokens fed back are argmax or feed."""
    cfg = ModelConfig.from_dir(model_dir)
    model = ReferenceModel(cfg, load_weights(model_dir, cfg), MAX_CONTEXT)
    rows = list(model.prefill(ids, return_all=True))
    tokens = []
    for step in range(STEPS):
        tokens.append(int(np.argmax(rows[-1])) if feed is None else feed[step])
        rows.append(model.decode(tokens[-1]))
    return np.stack(rows), tokens


@torch.no_grad()
def hf_run(model_dir, ids):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    out = model(torch.tensor([ids]), use_cache=True)
    rows = list(out.logits[0].numpy())
    tokens = []
    for _ in range(STEPS):
        tokens.append(int(np.argmax(rows[-1])))
        out = model(torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True)
        rows.append(out.logits[0, -1].numpy())
    return np.stack(rows), tokens


def rel_err(a, b):
    """max|a-b| / max|b| per row."""
    return np.abs(a - b).max(axis=-1) / np.abs(b).max(axis=-1)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{'tied' if c[1] else 'untied'}-{c[2]}x{c[3]}")
def test_matches_transformers(tmp_path, case):
    d = build(tmp_path, *case)
    ids = prompt(320)
    ours, our_tokens = reference_run(d, ids)
    theirs, their_tokens = hf_run(d, ids)
    err = rel_err(ours, theirs)
    assert err.max() <= RTOL, f"step {int(err.argmax()) - PROMPT_LEN + 1}: rel err {err.max():.2e}"
    assert our_tokens == their_tokens
    # the logits are far from flat, so greedy agreement means something
    assert np.ptp(theirs, axis=-1).min() > 2.0


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", [CASES[1], CASES[10]], ids=["llama", "qwen3"])
def test_low_precision_checkpoints(tmp_path, case, dtype):
    lowp, full = build(tmp_path, *case, dtype=dtype), build(tmp_path, *case)
    cfg = ModelConfig.from_dir(lowp)
    assert cfg.torch_dtype == dtype
    assert load_weights(lowp, cfg).layers[0].wqkv.dtype.name == dtype
    ids = prompt(320, seed=1)
    ours, tokens = reference_run(lowp, ids)
    # the same rounded weights upcast to float32 by transformers
    theirs, their_tokens = hf_run(lowp, ids)
    assert rel_err(ours, theirs).max() <= RTOL
    assert tokens == their_tokens
    # against the float32 weights they were rounded from, fed the same tokens
    exact, _ = reference_run(full, ids, feed=tokens)
    assert rel_err(ours, exact).max() <= LOWP_RTOL[dtype]


def test_split_count_and_reset(tmp_path):
    d = build(tmp_path, *CASES[2])
    cfg = ModelConfig.from_dir(d)
    weights = load_weights(d, cfg)
    ids = prompt(320, seed=2)
    runs = []
    for splits in (1, 7, 32):
        model = ReferenceModel(cfg, weights, MAX_CONTEXT, attn_splits=splits)
        model.prefill([5, 6, 7])
        model.reset()
        rows = [model.prefill(ids)] + [model.decode(t) for t in ids]
        assert model.pos == 2 * PROMPT_LEN
        runs.append(np.stack(rows))
    assert rel_err(runs[0], runs[2]).max() <= 1e-5
    assert rel_err(runs[1], runs[2]).max() <= 1e-5


def test_context_full_raises(tmp_path):
    d = build(tmp_path, *CASES[3])
    cfg = ModelConfig.from_dir(d)
    model = ReferenceModel(cfg, load_weights(d, cfg), max_context=PROMPT_LEN + 1)
    model.prefill(prompt(320))
    model.decode(3)
    with pytest.raises(GDecodeError, match="not fit the context"):
        model.decode(4)
    with pytest.raises(GDecodeError, match="out of range"):
        ReferenceModel(cfg, load_weights(d, cfg), 8).prefill([cfg.vocab_size])
