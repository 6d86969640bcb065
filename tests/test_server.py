"""`gdecode serve` as a client meets it: a real server process driven by the official `openai` client."""

from __future__ import annotations

import json
import math
import re
import signal
import subprocess
import time

import openai
import pytest

from engine.sampling import SamplingParams
from tests.serving import ENV, ROOT, Server, gdecode_cmd, in_threads, make_long_model, soak
from tests.tiny import make_tiny_model

SYSTEM = "You are terse."
QUESTION = "What is the capital of France?"
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("srv") / "tiny", "llama", tied=False, heads=4, kv_heads=2)


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    s = Server(tiny, tmp_path_factory.mktemp("log") / "serve.log")
    yield s
    assert s.stop() == 0, s.log()
    assert_clean_log(s.log())


@pytest.fixture(scope="module")
def long_server(tmp_path_factory):
    """A server whose requests can run for seconds, with room for one waiting request."""
    model = make_long_model(tmp_path_factory.mktemp("srv") / "long")
    s = Server(model, tmp_path_factory.mktemp("log") / "long.log", "--max-queue", "1", "--model-name", "tiny")
    yield s
    assert s.stop() == 0, s.log()
    assert_clean_log(s.log())


def assert_clean_log(log: str) -> None:
    assert "Traceback" not in log and " ERROR " not in log, log


def generate_cli(model, prompt, *args) -> str:
    r = subprocess.run(gdecode_cmd("generate", prompt, "--model", model, "--backend", "numpy", "--temperature", "0",
                                   *args), cwd=ROOT, env=ENV, capture_output=True, text=True, encoding="utf-8",
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.endswith("\n")
    return r.stdout[:-1]


def chat(client, messages, **kw):
    return client.chat.completions.create(model="tiny", messages=messages, **kw)


def streamed(stream) -> tuple[str, list]:
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


def test_models_and_health(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["tiny"]
    status, body, _ = server.post("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user",
                                                                                            "content": "x"}],
                                                            "max_tokens": 1})
    assert status == 200 and body["model"] == "tiny"
    import urllib.request

    with urllib.request.urlopen(server.url + "/health") as r:
        assert json.loads(r.read())["status"] == "ok"


def test_chat_greedy_matches_generate_chat(server, tiny):
    want = generate_cli(tiny, QUESTION, "--chat", "--system", SYSTEM, "-n", "24")
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    c = server.client()
    r = chat(c, messages, max_tokens=24, **GREEDY)
    assert r.choices[0].message.content == want
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    text, chunks = streamed(chat(c, messages, max_tokens=24, stream=True, stream_options={"include_usage": True},
                                 **GREEDY))
    assert text == want
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.object == "chat.completion.chunk" and ch.id == chunks[0].id for ch in chunks)
    assert chunks[-2].choices[0].finish_reason == r.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    # the same prompt again: all but its last token come from the cache, and nothing changes
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens - 1
    text, chunks = streamed(chat(c, messages, max_tokens=24, stream=True, **GREEDY))
    assert text == want and all(ch.usage is None for ch in chunks)


def test_completions_greedy_matches_generate(server, tiny):
    prompt = "Once upon a time"
    want = generate_cli(tiny, prompt, "-n", "20")
    c = server.client()
    r = c.completions.create(model="tiny", prompt=prompt, max_tokens=20, **GREEDY)
    assert r.object == "text_completion" and r.choices[0].text == want
    chunks = list(c.completions.create(model="tiny", prompt=prompt, max_tokens=20, stream=True,
                                       stream_options={"include_usage": True}, **GREEDY))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    ids = c.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=4, **GREEDY)
    assert ids.usage.prompt_tokens == 4


def test_stop_strings(server):
    c = server.client()
    msgs = [{"role": "user", "content": "Tell me about the lazy dog"}]
    full = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=40, extra_body={"ignore_eos": True},
                                     **GREEDY).choices[0].message.content
    assert len(full) > 10
    stop = full[6:9]
    cut = full.index(stop)
    for value in (stop, [stop, "\u2603never"]):
        r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=40, stop=value,
                                      extra_body={"ignore_eos": True}, **GREEDY)
        assert r.choices[0].message.content == full[:cut]
        assert r.choices[0].finish_reason == "stop"
        text, chunks = streamed(c.chat.completions.create(model="tiny", messages=msgs, max_tokens=40, stop=value,
                                                          stream=True, extra_body={"ignore_eos": True}, **GREEDY))
        assert text == full[:cut] and chunks[-1].choices[0].finish_reason == "stop"


def test_seed_and_length(server):
    c = server.client()
    msgs = [{"role": "user", "content": "Numbers"}]
    kw = dict(max_tokens=16, temperature=1.0, top_p=1.0, extra_body={"top_k": 0, "ignore_eos": True})
    a = chat(c, msgs, seed=7, **kw)
    b = chat(c, msgs, seed=7, **kw)
    d = chat(c, msgs, seed=8, **kw)
    assert a.choices[0].message.content == b.choices[0].message.content != d.choices[0].message.content
    assert a.choices[0].finish_reason == "length" and a.usage.completion_tokens == 16
    r = chat(c, msgs, max_completion_tokens=3, extra_body={"ignore_eos": True}, **GREEDY)
    assert r.usage.completion_tokens == 3


def test_unknown_fields_are_ignored(server):
    status, body, _ = server.post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi", "name": "bob"}], "max_tokens": 2, "user": "u1",
        "some_future_field": {"x": 1}, "parallel_tool_calls": False})
    assert status == 200, body
    assert body["usage"]["completion_tokens"] <= 2


def check_error(server, body, status, *needles, param=None):
    got, answer, _ = server.post("/v1/chat/completions", body)
    assert got == status, answer
    err = answer["error"]
    assert set(err) == {"message", "type", "param", "code"}
    for n in needles:
        assert n in err["message"], err
    if param is not None:
        assert err["param"] == param
    return err


def test_bad_requests_get_openai_errors(server, tiny):
    user = [{"role": "user", "content": "hi"}]
    check_error(server, '{"messages": [', 400, "not valid JSON")
    check_error(server, "[1, 2]", 400, "JSON object")
    check_error(server, {"messages": user, "max_tokens": "5"}, 400, "integer", param="max_tokens")
    check_error(server, {"messages": user, "temperature": "hot"}, 400, "number", param="temperature")
    check_error(server, {"messages": "hi"}, 400, param="messages")
    check_error(server, {"messages": [{"role": "user", "content": 5}]}, 400, param="messages[0].content")
    check_error(server, {}, 400, "required", param="messages")
    check_error(server, {"messages": user, "max_tokens": 0}, 400, "at least 1", param="max_tokens")
    check_error(server, {"messages": user, "max_tokens": -3}, 400, param="max_tokens")
    check_error(server, {"messages": user, "max_completion_tokens": 0}, 400, param="max_completion_tokens")
    err = check_error(server, {"messages": user, "model": "gpt-5"}, 404, "gpt-5", param="model")
    assert err["code"] == "model_not_found"
    check_error(server, {"messages": user, "n": 2}, 400, "not supported", param="n")
    check_error(server, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "wizard", param="messages[0].role")
    check_error(server, {"messages": []}, 400, "at least one", param="messages")
    check_error(server, {"messages": user, "temperature": -1}, 400, "'temperature' must be", param="temperature")
    check_error(server, {"messages": user, "top_p": 0}, 400, "'top_p' must be", param="top_p")
    # fields that would change the reply if honoured are refused, not ignored
    check_error(server, {"messages": user, "logit_bias": {"42": 5}}, 400, "not supported", param="logit_bias")
    check_error(server, {"messages": user, "response_format": {"type": "json_object"}}, 400, "json_object",
                param="response_format")
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    check_error(server, {"messages": user, "tools": [tool]}, 400, "not supported", param="tools")
    for harmless in ({"logit_bias": {}}, {"response_format": {"type": "text"}}, {"tools": []}):
        got, answer, _ = server.post("/v1/chat/completions", {"messages": user, "max_tokens": 1, **harmless})
        assert got == 200, (harmless, answer)
    # the request's names for the sampler's fields, not the engine's
    check_error(server, {"messages": user, "repetition_penalty": 0}, 400, "'repetition_penalty' must be",
                param="repetition_penalty")
    check_error(server, {"messages": user, "frequency_penalty": 1e39}, 400, "'frequency_penalty' must be",
                param="frequency_penalty")
    # the context holds 512 tokens: say by how much the prompt overflows it
    long = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. " * 60}]
    err = check_error(server, {"messages": long}, 400, "context", param="messages")
    m = re.search(r"prompt is (\d+) tokens but the context holds 512 .*: (\d+) tokens? too many", err["message"])
    assert m and int(m.group(2)) == int(m.group(1)) - 511 > 0, err
    assert err["code"] == "context_length_exceeded"
    got, answer, _ = server.post("/v1/chat/completions", json.dumps({"messages": user, "pad": "x" * (11 << 20)}))
    assert got == 413 and "10 MB" in answer["error"]["message"]
    # the same without a Content-Length: a chunked body is cut off at 10 MB too
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    parts = [b'{"messages": [{"role": "user", "content": "'] + [b"x" * (1 << 20)] * 11 + [b'"}]}']
    conn.request("POST", "/v1/chat/completions", body=iter(parts), encode_chunked=True,
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 413 and "10 MB" in json.loads(resp.read())["error"]["message"]
    conn.close()
    got, answer, _ = server.post("/v1/completions", {"prompt": ["a", "b"]})
    assert got == 400 and answer["error"]["param"] == "prompt"
    got, answer, _ = server.post("/v1/completions", {"prompt": [1, 99999]})
    assert got == 400 and "token id" in answer["error"]["message"]
    got, answer, _ = server.post("/v1/nothing", {})
    assert got == 404 and "error" in answer
    # the server is still up and serving
    assert chat(server.client(), user, max_tokens=2).usage.completion_tokens <= 2


def test_lone_surrogates_and_deep_nesting_are_bad_requests(server):
    # JSON may spell a lone UTF-16 surrogate as an escape; no text holds one (the tokenizer, the reply)
    lone = "x\ud800y"
    check_error(server, {"messages": [{"role": "user", "content": lone}]}, 400, "surrogate")
    check_error(server, {"messages": [{"role": "user", "content": [{"type": "text", "text": lone}]}]}, 400,
                "surrogate")
    check_error(server, {"messages": [{"role": "user", "content": "hi"}], "model": lone}, 400, "surrogate")
    got, answer, _ = server.post("/v1/completions", {"prompt": lone, "max_tokens": 2})
    assert got == 400 and "surrogate" in answer["error"]["message"], answer
    body = json.dumps({"prompt": lone, "max_tokens": 2}).encode("utf-16-le")
    got, answer, _ = server.post("/v1/completions", body)
    assert got == 400 and "surrogate" in answer["error"]["message"], answer
    check_error(server, '{"messages": [], "x": ' + "[" * 100_000 + "]" * 100_000 + "}", 400, "not valid JSON")
    # an integer past Python's int() limit is refused as too long, without quoting the limit's own advice
    err = check_error(server, '{"messages": [], "max_tokens": ' + "9" * 5000 + "}", 400)
    assert err["message"] == "a number in the request body is too long (over 4300 digits)", err
    # a surrogate pair is one character, and fine
    got, answer, _ = server.post("/v1/completions", '{"prompt": "hi \\ud83d\\ude00", "max_tokens": 2}')
    assert got == 200, answer
    assert "Traceback" not in server.log()


def test_bad_requests_through_the_client(server):
    c = server.client()
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        chat(c, [{"role": "user", "content": "x"}], max_tokens=0)
    with pytest.raises(openai.BadRequestError):
        chat(c, [{"role": "user", "content": "x"}], n=3)


SAMPLER_CASES = [
    ({"min_p": 0.2, "temperature": 1.0, "seed": 4}, dict(min_p=0.2, temperature=1.0, seed=4)),
    ({"repetition_penalty": 1.5}, dict(repeat_penalty=1.5)),
    ({"presence_penalty": 1.0, "frequency_penalty": 0.7}, dict(presence_penalty=1.0, frequency_penalty=0.7)),
    ({"top_k": 5, "top_p": 0.9, "temperature": 0.8, "seed": 11}, dict(top_k=5, top_p=0.9, temperature=0.8, seed=11)),
]


@pytest.mark.parametrize("body,kw", SAMPLER_CASES, ids=["min_p", "repeat", "presence_frequency", "top_k_top_p"])
def test_sampler_options_reach_the_sampler(server, tiny, body, kw):
    """The server's reply equals LLM.generate's with the same SamplingParams."""
    llm = sampler_llm(tiny)
    params = SamplingParams(**{"temperature": 0.0, "top_k": SamplingParams.top_k, **kw}, max_new_tokens=30)
    want = "".join(llm.generate("Tell me about foxes", params, chat=True))
    msgs = [{"role": "user", "content": "Tell me about foxes"}]
    status, got, _ = server.post("/v1/chat/completions", {"messages": msgs, "max_tokens": 30, "temperature": 0.0,
                                                          **body})
    assert status == 200, got
    assert got["choices"][0]["message"]["content"] == want


_LLMS: dict = {}


def sampler_llm(path):
    from engine.llm import LLM

    if path not in _LLMS:
        _LLMS[path] = LLM(path, backend="numpy")
    return _LLMS[path]


def test_logprobs(server):
    c = server.client()
    msgs = [{"role": "user", "content": "hello"}]
    r = chat(c, msgs, max_tokens=6, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True}, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    for e in content:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert e.token == e.top_logprobs[0].token and e.logprob == e.top_logprobs[0].logprob  # greedy: the best
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob
        assert sum(math.exp(t.logprob) for t in e.top_logprobs) <= 1.0 + 1e-6
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token
    chunks = list(chat(c, msgs, max_tokens=6, logprobs=True, top_logprobs=3, stream=True,
                       extra_body={"ignore_eos": True}, **GREEDY))
    streamed_lp = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    # the same tokens; the values move in the last float32 bits, as this prompt came from the cache
    assert [e.token for e in streamed_lp] == [e.token for e in content]
    assert [e.logprob for e in streamed_lp] == pytest.approx([e.logprob for e in content], abs=1e-5)
    plain = chat(c, msgs, max_tokens=6, extra_body={"ignore_eos": True}, **GREEDY)
    assert plain.choices[0].logprobs is None
    comp = c.completions.create(model="tiny", prompt="hello", max_tokens=5, logprobs=2, extra_body={"ignore_eos": True},
                                **GREEDY)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(len(t) <= 2 for t in lp.top_logprobs) and lp.text_offset == sorted(lp.text_offset)
    status, body, _ = server.post("/v1/chat/completions", {"messages": msgs, "top_logprobs": 30, "logprobs": True})
    assert status == 400 and body["error"]["param"] == "top_logprobs"
    status, body, _ = server.post("/v1/chat/completions", {"messages": msgs, "top_logprobs": 2})
    assert status == 400 and body["error"]["param"] == "top_logprobs"


def test_concurrent_clients(server):
    prompts = [f"Question {i}: what is {i} plus {i}?" for i in range(8)]
    c = server.client()
    want = [chat(c, [{"role": "user", "content": p}], max_tokens=12, **GREEDY).choices[0].message.content
            for p in prompts]
    got: dict[int, str] = {}

    def one(i):
        msgs = [{"role": "user", "content": prompts[i]}]
        if i % 2:
            got[i] = chat(server.client(), msgs, max_tokens=12, **GREEDY).choices[0].message.content
        else:
            got[i] = streamed(chat(server.client(), msgs, max_tokens=12, stream=True, **GREEDY))[0]

    in_threads(one, 8, 120)
    assert [got.get(i) for i in range(8)] == want


def test_prefix_reuse_across_turns(server):
    c = server.client()
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello, who are you?"}]
    r1 = chat(c, turn1, max_tokens=20, **GREEDY)
    turn2 = [*turn1, {"role": "assistant", "content": r1.choices[0].message.content},
             {"role": "user", "content": "And what do you do?"}]
    r2 = chat(c, turn2, max_tokens=20, **GREEDY)
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens
    cold = chat(c, turn2, max_tokens=20, extra_body={"cache_prompt": False}, **GREEDY)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert cold.choices[0].message.content == r2.choices[0].message.content
    assert cold.usage.completion_tokens == r2.usage.completion_tokens


def test_disconnect_cancels_and_next_request_runs(long_server):
    c = long_server.client()
    msgs = [{"role": "user", "content": "Write forever"}]
    stream = chat(c, msgs, max_tokens=4000, stream=True, **GREEDY)
    for i, _ in enumerate(stream):
        if i == 5:
            break
    stream.close()
    r = chat(c, [{"role": "user", "content": "short"}], max_tokens=3, **GREEDY)
    assert r.usage.completion_tokens == 3
    # the log line of the abandoned request says it was cancelled well before its 4000 tokens
    deadline = time.monotonic() + 10
    while not (m := re.search(r"request \d+ cancelled: prompt \d+ tokens \(\d+ cached\), (\d+) generated",
                              long_server.log())):
        assert time.monotonic() < deadline, long_server.log()
        time.sleep(0.1)
    assert int(m.group(1)) < 4000


def test_queue_full_gets_429(long_server):
    c = long_server.client()
    msgs = [{"role": "user", "content": "Write forever"}]
    running = chat(c, msgs, max_tokens=4000, stream=True, **GREEDY)
    next(iter(running))  # it is running now
    waiting = chat(long_server.client(), msgs, max_tokens=2, stream=True, **GREEDY)  # the one queue slot
    status, body, headers = long_server.post("/v1/chat/completions", {"messages": msgs, "max_tokens": 2})
    assert status == 429, body
    assert body["error"]["code"] == "queue_full" and int(headers["Retry-After"]) >= 1
    with pytest.raises(openai.RateLimitError):
        chat(c, msgs, max_tokens=2)
    running.close()
    text, chunks = streamed(waiting)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_graceful_shutdown_ends_running_stream(tmp_path):
    model = make_long_model(tmp_path / "m")
    s = Server(model, tmp_path / "serve.log", "--model-name", "tiny")
    try:
        stream = chat(s.client(), [{"role": "user", "content": "Write forever"}], max_tokens=4000, stream=True,
                      **GREEDY)
        it = iter(stream)
        next(it)
        s.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        rest = list(it)  # the stream ends: no hang, no error
        assert rest and rest[-1].choices[0].finish_reason == "abort"
        assert s.proc.wait(15) == 0
        assert time.monotonic() - t0 < 15
    finally:
        code = s.stop()
    assert code == 0
    assert_clean_log(s.log())
    assert "request 1 stopped by shutdown" in s.log()


@pytest.mark.slow
def test_soak_200_requests_from_8_clients(server):
    soak(server, "tiny", context=512)
    assert_clean_log(server.log())


def test_serve_command_errors_are_one_line(tmp_path, server):
    from tests.test_cli import assert_one_line_error

    def serve(*args):
        return subprocess.run(gdecode_cmd("serve", "--backend", "numpy", *args), cwd=ROOT, env=ENV,
                              capture_output=True, text=True, timeout=120)

    assert_one_line_error(serve("--model", tmp_path / "nope", "--port", "0"), "not found")
    assert_one_line_error(serve("--model", tmp_path / "nope", "--port", str(server.port)), "cannot listen")
    assert_one_line_error(serve("--log-level", "loud"), "log-level")
