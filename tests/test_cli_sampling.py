"""`gdecode generate` and `chat` sampling options: bad values, --logprobs JSON lines, the seed in use."""

import json
import math

import pytest

from engine.llm import LLM
from engine.sampling import SamplingParams, token_logprobs
from tests.test_cli import assert_one_line_error, gdecode
from tests.tiny import make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("cli_sampling") / "m", "llama", tied=False, heads=4, kv_heads=2)


# a bad value of each sampling option that generate and chat share; the error names the option itself
BAD_SHARED = [
    (("--temperature", "-1"), "error: --temperature must be"),
    (("--top-k", "-1"), "error: --top-k must be"),
    (("--top-p", "0"), "error: --top-p must be"),
    (("--min-p", "1.5"), "error: --min-p must be"),
    (("--min-p", "-0.1"), "error: --min-p must be"),
    (("--repeat-penalty", "inf"), "error: --repeat-penalty must be"),
    (("--repeat-penalty", "nan"), "error: --repeat-penalty must be"),
    (("--presence-penalty", "inf"), "error: --presence-penalty must be"),
    (("--frequency-penalty", "nan"), "error: --frequency-penalty must be"),
    (("--repeat-last-n", "-2"), "error: --repeat-last-n must be"),
    (("--seed", "-1"), "error: --seed must be"),
    (("--max-new-tokens", "0"), "error: --max-new-tokens must be >= 1, got 0"),
]


@pytest.mark.parametrize("backend", ["numpy", "cuda"])
@pytest.mark.parametrize("args,needle", [
    *BAD_SHARED,
    (("--logprobs", "21"), "error: --logprobs must be"),
    (("--logprobs", "-1"), "error: --logprobs must be"),
])
def test_bad_sampling_options(tiny, backend, args, needle):
    assert_one_line_error(gdecode("generate", "hi", "--model", tiny, "--backend", backend, *args), needle)


@pytest.mark.parametrize("args,needle", BAD_SHARED)
def test_chat_checks_each_sampling_option(tiny, args, needle):
    """chat shares generate's sampling options: each value reaches its own SamplingParams field."""
    assert_one_line_error(gdecode("chat", "--model", tiny, "--backend", "numpy", *args, stdin=""), needle)


def test_logprobs_json_lines_and_seed(tiny):
    r = gdecode("generate", "hello", "--model", tiny, "--backend", "numpy", "--max-new-tokens", "4", "--logprobs",
                "3", "--repeat-penalty", "1.2", "--presence-penalty", "0.3", "--min-p", "0.01")
    assert r.returncode == 0, r.stderr
    seeds = [ln for ln in r.stderr.splitlines() if ln.startswith("seed: ")]
    assert len(seeds) == 1
    seed = int(seeds[0].split()[1])
    rows = [json.loads(ln) for ln in r.stderr.splitlines() if ln.startswith("{")]
    assert 1 <= len(rows) <= 4
    for row in rows:
        assert len(row["top"]) == 3 and row["logprob"] <= 0 and isinstance(row["text"], str)
        lps = [t["logprob"] for t in row["top"]]
        assert lps == sorted(lps, reverse=True)
    # the same seed again: the same tokens and log-probabilities, and no seed line
    again = gdecode("generate", "hello", "--model", tiny, "--backend", "numpy", "--max-new-tokens", "4",
                    "--logprobs", "3", "--repeat-penalty", "1.2", "--presence-penalty", "0.3", "--min-p", "0.01",
                    "--seed", seed)
    assert again.returncode == 0 and again.stdout == r.stdout
    assert "seed: " not in again.stderr
    assert [json.loads(ln) for ln in again.stderr.splitlines() if ln.startswith("{")] == rows


def test_greedy_prints_no_seed(tiny):
    r = gdecode("generate", "hello", "--model", tiny, "--backend", "numpy", "--max-new-tokens", "2",
                "--temperature", "0")
    assert r.returncode == 0 and "seed: " not in r.stderr


def test_llm_logprobs_follow_the_model(tiny):
    llm = LLM(tiny, backend="numpy")
    params = SamplingParams(temperature=0.0, max_new_tokens=5, logprobs=2)
    text = "".join(llm.generate("hello", params))
    assert len(llm.logprobs) == llm.stats.new_tokens and text is not None
    ids = llm.encode_prompt("hello")
    model = llm.backend.model
    model.reset()
    logits = model.prefill(ids)
    for t in llm.logprobs:
        want = token_logprobs(logits, int(logits.argmax()), 2)
        assert t.token == want.token and math.isclose(t.logprob, want.logprob, abs_tol=1e-9)
        assert t.top == want.top
        logits = model.decode(t.token)
