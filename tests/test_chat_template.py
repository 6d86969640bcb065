"""Chat templates and long prompts as a hostile user writes them: each ends in one GDecodeError line,
quickly, with bounded memory; an ordinary template is unaffected."""

import time

import pytest

from engine.chat_template import ChatTemplate
from engine.errors import GDecodeError
from engine.tokenizer import COUNT_CHUNK, Tokenizer
from tests.test_tokenizer import make_tokenizer_dir

HOSTILE = {
    "nested loops": "{% set r = range(100000) %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}",
    "doubling string": "{% set ns = namespace(s='a') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                       "{% endfor %}{{ ns.s }}",
    "doubling list": "{% set ns = namespace(l=[1]) %}{% for i in range(64) %}{% set ns.l = ns.l + ns.l %}"
                     "{% endfor %}",
    "macro doubling": "{% macro f(s) %}{{ f(s ~ s) }}{% endmacro %}{{ f('ab') }}",
    "macro recursion": "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    "repeat": "{{ 'a' * 10000000000 }}",
    "power": "{{ 10 ** 100000000 }}",
    "center filter": "{{ 'a' | center(10000000000) }}",
    "center method": "{{ 'a'.center(10000000000) }}",
    "format width": "{{ '{:9999999999}'.format(1) }}",
    "percent width": "{{ '%9999999999d' % 1 }}",
    "format filter": "{{ '%9999999999d' | format(1) }}",
    "huge output": "{% for i in range(100000) %}{% for j in range(100) %}{{ 'x' * 1000 }}{% endfor %}{% endfor %}",
    "replace blow-up": "{{ ('x' * 10000000) | replace('x', 'y' * 10000000) }}",
    "include": "{% include 'other.jinja' %}",
    "import": "{% import 'macros.jinja' as m %}",
    "from import": "{% from 'macros.jinja' import m %}",
    "extends": "{% extends 'base.jinja' %}",
    "type error": "{{ 1 + 'a' }}",
    "syntax error": "{% for %}",
    "unknown filter": "{{ messages | nosuchfilter }}",
    "sandbox escape": "{{ messages.__class__.__mro__[1].__subclasses__() }}",
    "undefined call": "{{ nosuchfunction() }}",
}


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_template_is_one_error_line(name):
    t0 = time.monotonic()
    with pytest.raises(GDecodeError) as e:
        ChatTemplate(HOSTILE[name], "m/tokenizer_config.json").render(
            max_chars=1 << 20, seconds=0.5, messages=[{"role": "user", "content": "hi"}])
    msg = str(e.value)
    assert msg.startswith("m/tokenizer_config.json: chat template: ") and "\n" not in msg
    assert time.monotonic() - t0 < 5  # bounded: stopped at its time or size limit


@pytest.mark.parametrize("name", ["include", "import", "from import", "extends"])
def test_include_and_import_are_named(name):
    with pytest.raises(GDecodeError, match="is not supported"):
        ChatTemplate(HOSTILE[name], "t")


def test_ordinary_template_and_its_numbers_render():
    src = ("{% for m in messages %}{{ '%-6s' % m['role'] }}|{{ '{:>3}'.format(loop.index) }}|"
           "{{ m['content'] | trim }}\n{% endfor %}call 20261201")
    out = ChatTemplate(src, "t").render(messages=[{"role": "user", "content": " hi "}, {"role": "bot", "content": "x"}])
    assert out == "user  |  1|hi\nbot   |  2|x\ncall 20261201"


def test_size_bound_counts_output_and_values():
    t = ChatTemplate("{{ messages[0]['content'] }}{{ messages[0]['content'] }}", "t")
    msg = [{"content": "x" * 600}]
    assert len(t.render(max_chars=1200, messages=msg)) == 1200
    with pytest.raises(GDecodeError, match="bound of 1,000"):
        t.render(max_chars=1000, messages=msg)
    assert len(t.render(max_chars=1200, messages=msg)) == 1200  # the bound is per render


def test_tokenizer_passes_its_bounds(tmp_path):
    d = make_tokenizer_dir(tmp_path, config={"chat_template": HOSTILE["nested loops"]})
    t0 = time.monotonic()
    with pytest.raises(GDecodeError, match="longer than 0.2 s"):
        Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "x"}], seconds=0.2)
    assert time.monotonic() - t0 < 3


def test_time_bound_never_lands_outside_its_render():
    """Deadlines that fall just before, during and just after a render's end: each render either
    returns its text or raises the one-line error, and nothing fires in the code that runs after it."""
    t = ChatTemplate("{% for i in range(200) %}{{ m[i % 3] }}{% endfor %}", "t")  # m[...] looks at the clock
    full = t.render(m="abc")
    took = min(_timed(lambda: t.render(m="abc")) for _ in range(5))
    outcomes = set()
    for i in range(300):
        try:
            outcomes.add(t.render(seconds=took * (0.2 + 1.6 * i / 300), m="abc") == full)
        except GDecodeError as e:
            assert "longer than" in str(e)
            outcomes.add("stopped")
        total = 0
        for k in range(20000):  # plenty of bytecode boundaries where a stray raise would land
            total += k
        assert total == 199990000
    assert "stopped" in outcomes and True in outcomes


def test_a_runaway_render_does_not_stop_another_thread():
    import threading
    results = {}

    def hostile():
        try:
            ChatTemplate(HOSTILE["nested loops"], "t").render(seconds=0.3)
        except GDecodeError as e:
            results["hostile"] = str(e)

    def ordinary():
        t = ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}", "t")
        results["ordinary"] = [t.render(seconds=5, messages=[{"content": "a"}] * 50) for _ in range(200)]

    threads = [threading.Thread(target=hostile), threading.Thread(target=ordinary)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(10)
    assert "longer than 0.3 s" in results["hostile"]
    assert results["ordinary"] == ["a" * 50] * 200


def _timed(f):
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


class _Recorder:
    """The tokenizers object with every encoded text's length written down."""

    def __init__(self, tok):
        self.tok, self.lengths = tok, []

    def encode(self, text, add_special_tokens=True):
        self.lengths.append(len(text))
        return self.tok.encode(text, add_special_tokens=add_special_tokens)

    def __getattr__(self, name):
        return getattr(self.tok, name)


@pytest.fixture
def tok(tmp_path):
    t = Tokenizer.from_dir(make_tokenizer_dir(tmp_path))
    t._tok = _Recorder(t._tok)
    return t


def test_prompt_over_the_byte_bound_is_not_tokenized(tok):
    text = "hello world " * 1_000_000
    with pytest.raises(GDecodeError, match="bytes, more than a context of 512 tokens"):
        tok.encode(text, max_tokens=512)
    assert tok._tok.lengths == []


def test_long_prompt_is_counted_in_chunks_and_stopped_early(tok):
    ctx = (COUNT_CHUNK * 2) // tok.max_token_bytes  # the byte bound lets ~4 chunks through
    text = "the quick brown fox jumps over the lazy dog; " * (4 * COUNT_CHUNK // 45)
    assert len(text.encode()) <= tok.max_text_bytes(ctx)
    with pytest.raises(GDecodeError, match=f"but the context holds {ctx}"):
        tok.encode(text, max_tokens=ctx)
    assert max(tok._tok.lengths) <= COUNT_CHUNK
    assert sum(tok._tok.lengths) < len(text)  # stopped before the end


def test_prompt_that_fits_is_encoded_exactly(tok):
    text = "hello café 😀 " * 40
    assert tok.encode(text, max_tokens=4096) == tok.encode(text)
