"""KV-cache prefix reuse: a prompt that starts with what the cache holds prefills only the rest,
and the tokens come out exactly as without reuse."""

from __future__ import annotations

import numpy as np
import pytest

from engine.llm import LLM
from engine.prefix import shared_prefix
from engine.sampling import SamplingParams
from tests.tiny import make_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=64)
SAMPLED = SamplingParams(temperature=0.9, top_k=0, top_p=1.0, seed=1234, max_new_tokens=64)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def llm(request, tmp_path_factory):
    d = make_tiny_model(tmp_path_factory.mktemp("reuse") / request.param, request.param, tied=False, heads=4,
                        kv_heads=2)
    return LLM(d, backend="numpy")


def run(backend, ids, params, n, reuse):
    return list(backend.generate(ids, params, n, reuse=reuse))


def test_shared_prefix():
    assert shared_prefix([], [1, 2]) == 0
    assert shared_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert shared_prefix([1, 2, 3], [1, 2, 3, 4]) == 3
    # the last prompt token always runs: its logits pick the first new token
    assert shared_prefix([1, 2, 3], [1, 2, 3]) == 2
    assert shared_prefix([1, 2, 3, 4, 5], [1, 2]) == 1


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_multi_turn_tokens_equal_without_reuse(llm, params):
    rng = np.random.default_rng(7)
    be, vocab = llm.backend, llm.cfg.vocab_size

    def fresh(k):
        return [int(t) for t in rng.integers(3, vocab, k)]

    ids = fresh(20)
    expected = shared_prefix(be.held, ids)  # whatever an earlier test left behind
    for turn in range(6):
        n = int(rng.integers(4, 30))
        warm = run(be, ids, params, n, reuse=True)
        assert be.reused == expected, f"turn {turn}"
        # the cache holds the prompt and every sampled token but the last (which never ran)
        assert be.held == ids + warm[:-1]
        cold = run(be, ids, params, n, reuse=False)
        assert be.reused == 0
        assert warm == cold, f"turn {turn}"
        if turn == 3:  # an edit inside the history: only what comes before it is reused
            cut = len(ids) // 2
            edit = (ids[cut] + 1 - 3) % (vocab - 3) + 3
            ids, expected = ids[:cut] + [edit] + fresh(5), cut
        else:  # the history so far, then a new message
            ids, expected = ids + warm + fresh(int(rng.integers(1, 12))), len(ids) + len(warm) - 1


def test_another_prompt_in_between_replaces_the_cache(llm):
    be = llm.backend
    a = llm.tokenizer.encode("Hello, world! This is a tiny tokenizer.")
    b = llm.tokenizer.encode("def main():")
    first = run(be, a, GREEDY, 8, reuse=True)
    run(be, b, GREEDY, 8, reuse=True)
    assert be.reused == shared_prefix(a + first[:-1], b)
    again = run(be, a + first, GREEDY, 8, reuse=True)
    assert be.reused == shared_prefix(b, a)
    assert again == run(be, a + first, GREEDY, 8, reuse=False)


def test_same_prompt_again_reuses_all_but_the_last_token(llm):
    be = llm.backend
    ids = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    first = run(be, ids, GREEDY, 10, reuse=True)
    again = run(be, ids, GREEDY, 10, reuse=True)
    assert be.reused == len(ids) - 1
    assert again == first


def test_early_close_keeps_only_what_ran(llm):
    be = llm.backend
    ids = llm.tokenizer.encode("Once upon a time")
    gen = be.generate(ids, GREEDY, 50, reuse=False)
    got = [next(gen) for _ in range(7)]
    gen.close()
    assert be.held == ids + got[:-1]
    more = run(be, ids + got + [5, 6], GREEDY, 8, reuse=True)
    assert be.reused == len(ids) + len(got) - 1
    assert more == run(be, ids + got + [5, 6], GREEDY, 8, reuse=False)


def test_reused_logits_match_a_full_prefill(llm):
    """The logits after a reused prefix equal those of one prefill of the whole prompt."""
    rng = np.random.default_rng(3)
    model = llm.backend.model
    ids = [int(t) for t in rng.integers(3, llm.cfg.vocab_size, 40)]
    model.reset()
    full = model.prefill(ids)
    model.reset()
    model.prefill(ids[:25])
    part = model.prefill(ids[25:])
    np.testing.assert_allclose(part, full, rtol=1e-5, atol=1e-5)


def test_ten_turn_chat_prefills_only_new_tokens(llm):
    """Through the serving engine: each turn's uncached tokens are its new message and the previous
    reply (re-tokenized from text), never the history before them."""
    import queue

    from engine.serving import Delta, Finished, Request, ServingEngine

    engine = ServingEngine(lambda: llm)
    engine.start()
    try:
        tok = llm.tokenizer
        history = [{"role": "system", "content": "Answer briefly."}]
        rng = np.random.default_rng(11)
        words = "the quick brown fox jumps over lazy dog hello world tiny model".split()
        prev: list[int] = []
        for turn in range(10):
            history.append({"role": "user", "content": " ".join(rng.choice(words, int(rng.integers(1, 5))))})
            ids = tok.encode_chat(history)
            events: queue.Queue = queue.Queue()
            engine.submit(Request(ids, SamplingParams(temperature=0.0, max_new_tokens=6), events.put))
            text = []
            while not isinstance(ev := events.get(timeout=60), Finished):
                assert isinstance(ev, Delta), ev
                text.append(ev.text)
            if turn:
                # all of the previous prompt comes from the cache; what is prefilled is what this turn added
                assert ev.usage.cached_tokens >= len(prev) - 1, (turn, ev.usage)
                assert ev.usage.prompt_tokens - ev.usage.cached_tokens <= len(ids) - len(prev) + 1
            history.append({"role": "assistant", "content": "".join(text)})
            prev = ids
        assert len(ids) > 5 * (len(ids) - ev.usage.cached_tokens)  # the history is much longer
    finally:
        engine.stop()
        assert engine.join(10)
