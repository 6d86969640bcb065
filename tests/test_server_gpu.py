"""Prefix reuse on the CUDA backend, and the server's client flow on it (the real SmolLM2 when present)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from engine.config import ModelConfig
from engine.llm import DEFAULT_MODEL
from engine.prefix import shared_prefix
from engine.sampling import SamplingParams
from engine.weights import load_weights
from tests.serving import ENV, ROOT, Server, gdecode_cmd, in_threads, make_long_model, soak
from tests.tiny import make_tiny_model

pytestmark = pytest.mark.gpu
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=64)
SAMPLED = SamplingParams(temperature=0.9, top_k=0, top_p=1.0, seed=99, max_new_tokens=64)
ARCHS = {"llama": dict(heads=4, kv_heads=2, tied=False), "qwen3": dict(heads=4, kv_heads=1, tied=False, head_dim=32)}


@pytest.fixture(scope="module", params=list(ARCHS))
def cuda_backend(request, tmp_path_factory):
    from engine.backend_cuda import CudaBackend

    d = make_tiny_model(tmp_path_factory.mktemp("reuse") / request.param, request.param, **ARCHS[request.param])
    cfg = ModelConfig.from_dir(d)
    return CudaBackend(cfg, load_weights(d, cfg), max_context=512)


def assert_same_or_near_tie(be, ids, warm, cold, params, tie=2e-2):
    """warm (with reuse) equals cold (without), or first differs where the cold run's logits hold a near
    tie: the reused K/V of earlier replies came from decode steps, the cold run's from the batched
    prefill, and the two round to bf16 apart now and then."""
    if warm == cold:
        return
    d = next(i for i, (a, b) in enumerate(zip(warm, cold, strict=False)) if a != b)
    assert params.greedy, f"sampled tokens differ at {d} of {len(cold)}"
    be.start(ids, params, 0, prefill=True)
    for _ in range(d + 1):
        be.replay()
    logits = be.step_logits()
    assert int(np.argmax(logits)) == cold[d]
    gap = float(logits[cold[d]] - logits[warm[d]])
    list(be.generate(ids, params, len(cold), reuse=False))  # the cache as the cold run left it
    assert gap <= tie * max(1.0, float(np.abs(logits).max())), f"tokens differ at {d} with a logit gap of {gap}"


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_cuda_multi_turn_tokens_equal_without_reuse(cuda_backend, params):
    be = cuda_backend
    rng = np.random.default_rng(5)

    def fresh(k):
        return [int(t) for t in rng.integers(3, be.cfg.vocab_size, k)]

    ids = fresh(24)
    for turn in range(6):
        expected = shared_prefix(be.held, ids)
        n = int(rng.integers(4, 40))
        warm = list(be.generate(ids, params, n, reuse=True))
        assert be.reused == expected and (turn == 0 or expected > 0)
        # replays run ahead of the tokens read, so the cache may hold the last sampled token too
        assert be.held[: len(ids) + len(warm) - 1] == ids + warm[:-1]
        assert be.held == (ids + warm)[: len(be.held)]
        cold = list(be.generate(ids, params, n, reuse=False))
        assert be.reused == 0
        assert_same_or_near_tie(be, ids, warm, cold, params)
        ids = ids + warm + fresh(int(rng.integers(1, 16)))
    assert be.bufs.guards_intact()


def test_smollm2_multi_turn_reuse_equals_cold(model):
    """The real model's chat turns with and without reuse: the same tokens, up to a near tie."""
    from engine.llm import LLM

    llm = LLM(model, backend="cuda", max_context=4096)
    be, tok = llm.backend, llm.tokenizer
    history = [{"role": "system", "content": "You are a helpful assistant."}]
    for q in ["Name a fruit.", "What colour is it?", "Give me a recipe with it.", "How long does it take?"]:
        history.append({"role": "user", "content": q})
        ids = tok.encode_chat(history)
        warm = list(be.generate(ids, GREEDY, 64, reuse=True))
        assert len(history) == 2 or be.reused > len(ids) // 2
        cold = list(be.generate(ids, GREEDY, 64, reuse=False))
        assert_same_or_near_tie(be, ids, warm, cold, GREEDY)
        history.append({"role": "assistant", "content": tok.decode(cold)})


def test_cuda_early_close_keeps_what_ran(cuda_backend):
    be = cuda_backend
    ids = [5, 17, 99, 3, 250, 8, 42]
    gen = be.generate(ids, GREEDY, 100, reuse=False)
    got = [next(gen) for _ in range(9)]
    gen.close()
    assert len(be.held) >= len(ids) + len(got) - 1 and be.held == (ids + got)[: len(be.held)]
    nxt = ids + got + [7, 7, 7]
    more = list(be.generate(nxt, GREEDY, 12, reuse=True))
    assert be.reused >= len(ids) + len(got) - 1
    assert more == list(be.generate(nxt, GREEDY, 12, reuse=False))


@pytest.fixture(scope="module")
def model():
    if not (DEFAULT_MODEL / "config.json").is_file():
        pytest.skip("the default model is not installed (make model)")
    return DEFAULT_MODEL


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    s = Server(model, tmp_path_factory.mktemp("log") / "serve.log", "--model-name", "smol", "--max-context", "4096",
               backend="cuda")
    yield s
    assert s.stop() == 0, s.log()
    assert "Traceback" not in s.log()


def chat(client, messages, **kw):
    return client.chat.completions.create(model="smol", messages=messages, **kw)


def test_cuda_server_greedy_matches_generate(server, model):
    r = subprocess.run(gdecode_cmd("generate", "What is the capital of France?", "--model", model, "--backend",
                                   "cuda", "--temperature", "0", "-n", "48", "--chat", "--system", "Be brief."),
                       cwd=ROOT, env=ENV, capture_output=True, text=True, encoding="utf-8", timeout=600)
    assert r.returncode == 0, r.stderr
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]
    c = server.client()
    whole = chat(c, msgs, max_tokens=48, temperature=0.0)
    assert whole.choices[0].message.content == r.stdout[:-1]
    chunks = list(chat(c, msgs, max_tokens=48, temperature=0.0, stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == r.stdout[:-1]
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == whole.usage.prompt_tokens - 1


def test_cuda_server_logprobs(server):
    r = chat(server.client(), [{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0.0,
             logprobs=True, top_logprobs=5, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 8
    for e in content:  # greedy: the chosen token is the most likely one
        assert e.token == e.top_logprobs[0].token and e.logprob == pytest.approx(e.top_logprobs[0].logprob)
        assert len(e.top_logprobs) == 5 and e.logprob <= 0


def test_cuda_server_multi_turn_reuses_the_cache(server):
    c = server.client()
    history = [{"role": "system", "content": "You are a helpful assistant."}]
    prev_prompt = 0
    for q in ["Name a fruit.", "What colour is it?", "Give me a recipe with it.", "How long does it take?"]:
        history.append({"role": "user", "content": q})
        r = chat(c, history, max_tokens=64, temperature=0.0)
        assert r.usage.prompt_tokens_details.cached_tokens >= prev_prompt - 1
        prev_prompt = r.usage.prompt_tokens
        history.append({"role": "assistant", "content": r.choices[0].message.content})


def test_cuda_server_concurrency_and_disconnect(server):
    prompts = [f"Write a sentence about the number {i}." for i in range(8)]
    want = [chat(server.client(), [{"role": "user", "content": p}], max_tokens=24, temperature=0.0)
            .choices[0].message.content for p in prompts]
    got = {}

    def one(i):
        got[i] = chat(server.client(), [{"role": "user", "content": prompts[i]}], max_tokens=24,
                      temperature=0.0).choices[0].message.content

    in_threads(one, 8, 300)
    assert [got.get(i) for i in range(8)] == want
    stream = chat(server.client(), [{"role": "user", "content": "Tell me a very long story."}], max_tokens=3000,
                  temperature=0.0, stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 10:
            break
    stream.close()
    assert chat(server.client(), [{"role": "user", "content": "Hi"}], max_tokens=4).usage.completion_tokens <= 4
    deadline = time.monotonic() + 10
    while not (m := re.search(r"cancelled: prompt \d+ tokens \(\d+ cached\), (\d+) generated", server.log())):
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.1)
    assert int(m.group(1)) < 3000


def test_cuda_server_soak_200_requests_from_8_clients(server):
    """The soak of tests/test_server.py on the CUDA backend and the real model: sampled and greedy
    requests, streams dropped mid-way and bad requests from 8 clients at once."""
    rss = soak(server, "smol", context=4096)
    print(f"server RSS after 50 requests {rss[50] / 1024:.1f} MiB, after 200 {rss[200] / 1024:.1f} MiB")
    log = server.log()
    assert "Traceback" not in log and " ERROR " not in log, log[-4000:]


def test_cuda_server_graceful_shutdown(tmp_path):
    model = make_long_model(tmp_path / "m")
    s = Server(model, tmp_path / "serve.log", "--model-name", "smol", backend="cuda")
    try:
        it = iter(chat(s.client(), [{"role": "user", "content": "go"}], max_tokens=4000, temperature=0.0,
                       stream=True, extra_body={"ignore_eos": True}))
        next(it)
        s.proc.send_signal(signal.SIGTERM)
        rest = list(it)
        assert rest[-1].choices[0].finish_reason == "abort"
        assert s.proc.wait(30) == 0
    finally:
        assert s.stop() == 0
    assert "Traceback" not in s.log()


def test_serve_bench_runs(model):
    """The measurement script end to end (its numbers are for reading, not asserting)."""
    r = subprocess.run([sys.executable, "dev/serve_bench.py", "--model", str(model), "--tokens", "256",
                        "--repeats", "3"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900)
    print(r.stdout)
    assert r.returncode == 0, r.stderr
    assert "streamed/baseline tok/s" in r.stdout and "10-turn chat" in r.stdout
