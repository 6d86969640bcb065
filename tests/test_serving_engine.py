"""The serving engine without HTTP: FIFO scheduling, cancellation, shutdown, and the same text as LLM.generate."""

from __future__ import annotations

import queue
import threading
from contextlib import contextmanager

import pytest

from engine.errors import GDecodeError
from engine.llm import LLM
from engine.sampling import SamplingParams
from engine.serving import Delta, Failed, Finished, QueueFull, Request, ServingEngine, ShuttingDown
from engine.serving.scheduler import Scheduler
from tests.serving import make_long_model
from tests.tiny import make_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(make_tiny_model(tmp_path_factory.mktemp("eng") / "m", "qwen2", tied=True, heads=4, kv_heads=1),
               backend="numpy")


@pytest.fixture(scope="module")
def long_llm(tmp_path_factory):
    return LLM(make_long_model(tmp_path_factory.mktemp("eng") / "long"), backend="numpy")


class Collector:
    def __init__(self):
        self.events: queue.Queue = queue.Queue()

    def __call__(self, ev):
        self.events.put(ev)

    def wait(self, timeout=60.0):
        """(text, last event)"""
        text = []
        while True:
            ev = self.events.get(timeout=timeout)
            if isinstance(ev, Delta):
                text.append(ev.text)
            else:
                return "".join(text), ev


@contextmanager
def running(engine: ServingEngine):
    """The engine started, then stopped and joined however the block ends."""
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()
        assert engine.join(10)


def request(ids, params=GREEDY, **kw):
    c = Collector()
    return Request(list(ids), params, c, **kw), c


def test_scheduler_is_bounded_fifo():
    s = Scheduler(3)
    reqs = [request([1])[0] for _ in range(4)]
    for r in reqs[:3]:
        s.add(r)
    with pytest.raises(QueueFull):
        s.add(reqs[3])
    assert len(s) == 3
    assert [s.pop(0) for _ in range(3)] == reqs[:3]
    assert s.pop(0.01) is None
    s.add(reqs[3])
    assert s.drain() == [reqs[3]] and len(s) == 0
    with pytest.raises(GDecodeError):
        Scheduler(0)


def test_text_equals_llm_generate(llm):
    prompts = ["Hello, world!", "def main():", "The quick brown fox"]
    want = [("".join(llm.generate(p, GREEDY, chat=True)), llm.stats) for p in prompts]
    with running(ServingEngine(lambda: llm)) as engine:
        pending = [request(llm.encode_prompt(p, chat=True)) for p in prompts]
        for r, _ in pending:
            engine.submit(r)
        for (text, stats), (_, c) in zip(want, pending, strict=True):
            got, end = c.wait()
            assert isinstance(end, Finished)
            assert got == text
            assert end.usage.completion_tokens == stats.new_tokens
            assert end.reason == {"eos": "stop", "length": "length"}[stats.stop_reason]


def test_requests_run_in_order_and_cancel(long_llm):
    with running(ServingEngine(lambda: long_llm, max_waiting=8)) as engine:
        order = []
        lock = threading.Lock()
        runs = []
        for i in range(4):
            c = Collector()

            def emit(ev, i=i, c=c):
                if isinstance(ev, Finished):
                    with lock:
                        order.append(i)
                c(ev)

            r = Request([5, 6, 7 + i], SamplingParams(temperature=0.0, max_new_tokens=2000), emit)
            runs.append((r, c))
        runs[2][0].cancel()  # cancelled while waiting: never runs
        for r, _ in runs:
            engine.submit(r)
        first = runs[0][1].events.get(timeout=60)
        assert isinstance(first, Delta)
        runs[0][0].cancel()  # cancelled while running: stops at the next token
        ends = [c.wait()[1] for _, c in runs]
        assert order == [0, 1, 2, 3]
        assert ends[0].reason == "abort" and ends[0].usage.completion_tokens < 2000
        assert ends[1].reason == "length" and ends[1].usage.completion_tokens == 2000
        assert ends[2].reason == "abort" and ends[2].usage.completion_tokens == 0


def test_stop_ends_running_and_fails_waiting(long_llm):
    engine = ServingEngine(lambda: long_llm, max_waiting=2)
    engine.start()
    params = SamplingParams(temperature=0.0, max_new_tokens=3000)
    (a, ca), (b, cb), (c, _) = request([5, 6], params), request([7, 8], params), request([9], params)
    engine.submit(a)
    engine.submit(b)
    with pytest.raises(QueueFull):
        engine.submit(c)
    assert isinstance(ca.events.get(timeout=60), Delta)
    engine.stop()
    assert ca.wait()[1].reason == "abort"
    end = cb.wait()[1]
    assert isinstance(end, Failed) and end.kind == "shutdown"
    assert engine.join(10)
    with pytest.raises(ShuttingDown):
        engine.submit(request([1])[0])


def test_bad_prompt_fails_without_stopping_the_engine(llm):
    with running(ServingEngine(lambda: llm)) as engine:
        r, c = request(range(3, 3 + llm.max_context))
        engine.submit(r)
        end = c.wait()[1]
        assert isinstance(end, Failed) and end.kind == "invalid" and "too many" in end.message
        r, c = request([5, 6, 7])
        engine.submit(r)
        assert isinstance(c.wait()[1], Finished)


def test_load_error_reaches_start(tmp_path):
    def load():
        raise GDecodeError("no such model")

    with pytest.raises(GDecodeError, match="no such model"):
        ServingEngine(load).start()
