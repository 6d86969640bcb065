"""`gdecode chat`: history, streamed replies, prefix reuse, /clear and /exit, Ctrl-C and Ctrl-D."""

from __future__ import annotations

import fcntl
import os
import platform
import re
import select
import signal
import subprocess
import termios
import time

import pytest

from tests.serving import ENV, ROOT, gdecode_cmd, make_long_model
from tests.tiny import make_tiny_model

STATS = re.compile(r"\[prompt (\d+) tokens, (\d+) cached; (\d+) generated")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("chat") / "m", "llama", tied=True, heads=4, kv_heads=4)


def chat(model, stdin: str, *args):
    cmd = gdecode_cmd("chat", "--model", model, "--backend", "numpy", "--temperature", "0", "-v", *args)
    return subprocess.run(cmd, cwd=ROOT, env=ENV, input=stdin, capture_output=True, text=True, encoding="utf-8",
                          timeout=300)


def test_turns_reuse_the_cache_and_match_generate(tiny):
    r = chat(tiny, "What is the capital of France?\nAnd of Spain?\n/clear\n/nope\nHello\n", "--system", "Be brief.",
             "-n", "12")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    stats = [tuple(map(int, m)) for m in STATS.findall(r.stderr)]
    assert len(stats) == 3, r.stderr
    (p1, c1, g1), (p2, c2, g2), (p3, c3, _) = stats
    assert c1 == 0
    assert c2 >= p1 and p2 > p1  # turn 2 holds turn 1, and turn 1 came from the cache
    assert p3 < p2  # /clear forgot the history (the cache may still share the system message)
    assert "(conversation cleared)" in r.stderr and "unknown command /nope" in r.stderr
    gen = subprocess.run(gdecode_cmd("generate", "What is the capital of France?", "--model", tiny, "--backend",
                                     "numpy", "--temperature", "0", "-n", "12", "--chat", "--system", "Be brief."),
                         cwd=ROOT, env=ENV, capture_output=True, text=True, encoding="utf-8", timeout=300)
    assert gen.returncode == 0, gen.stderr
    assert r.stdout.startswith(gen.stdout)


def test_exit_command_leaves(tiny):
    r = chat(tiny, "/exit\nthis is never answered\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "" and "[prompt" not in r.stderr


def test_too_long_a_message_is_an_error_and_chat_goes_on(tiny):
    r = chat(tiny, "word " * 60 + "\n" + "word " * 6000 + "\nhi\n", "--max-context", "64", "-n", "4")
    assert r.returncode == 0, r.stderr
    assert re.search(r"error: the prompt is \d+ tokens but the context holds 64 .*: \d+ tokens too many", r.stderr)
    assert re.search(r"error: the messages .* more than a context of 64 tokens", r.stderr)  # refused untokenized
    assert len(STATS.findall(r.stderr)) == 1


def test_invalid_utf8_in_a_message_or_the_system_message_is_replaced(tiny):
    # stdin is strict UTF-8 under ENV (PYTHONIOENCODING=utf-8); the argument reaches Python as surrogates
    cmd = gdecode_cmd("chat", "--model", tiny, "--backend", "numpy", "--temperature", "0", "-n", "2",
                      "--system", os.fsdecode(b"be \xff brief"))
    r = subprocess.run(cmd, cwd=ROOT, env=ENV, input=b"hi \xfe\xff there\n", capture_output=True, timeout=300)
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 0, err
    assert "Traceback" not in err and "error:" not in err
    assert "warning: --system is not valid UTF-8" in err
    assert "warning: the message is not valid UTF-8" in err


def test_system_needs_chat_in_generate(tiny):
    r = subprocess.run(gdecode_cmd("generate", "x", "--model", tiny, "--backend", "numpy", "--system", "s"),
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and r.stderr.strip() == "error: --system needs --chat"


_WAITING = {"x86_64": ("7", "23", "270", "271"), "aarch64": ("72", "73")}  # poll, select, pselect6, ppoll


class Terminal:
    """The chat on a pseudo-terminal that is its controlling terminal, so ^C and ^D act as they do for a user."""

    def __init__(self, *args):
        self.master, slave = os.openpty()

        def own_tty():
            os.setsid()
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)
            # as a shell on a terminal starts it: a suite run in the background (`cmd &`) ignores SIGINT, which
            # the chat would inherit, and Python then raises no KeyboardInterrupt at the prompt
            signal.signal(signal.SIGINT, signal.SIG_DFL)

        self.proc = subprocess.Popen(gdecode_cmd("chat", *args), cwd=ROOT, env=ENV, stdin=slave, stdout=slave,
                                     stderr=slave, preexec_fn=own_tty)
        os.close(slave)
        self.screen = ""

    def read_until(self, pattern: str, timeout: float = 120.0) -> str:
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.screen):
            left = deadline - time.monotonic()
            assert left > 0, f"no {pattern!r} in:\n{self.screen}"
            if select.select([self.master], [], [], min(left, 1.0))[0]:
                try:
                    self.screen += os.read(self.master, 65536).decode("utf-8", "replace")
                except OSError:  # the child closed the terminal
                    assert re.search(pattern, self.screen), f"no {pattern!r} in:\n{self.screen}"
        return self.screen

    def type(self, text: str) -> None:
        os.write(self.master, text.encode())

    def wait_for_input(self, timeout: float = 30.0) -> None:
        """Wait until the chat's main thread blocks in readline's select(). CPython's readline looks for
        a pending Ctrl-C only when select() is interrupted, so a SIGINT that lands between the prompt's
        write and select() waits for the next keystroke: a window of microseconds for a person, but one
        that a test typing the moment the prompt shows, on a busy machine, hits every time."""
        path = f"/proc/{self.proc.pid}/task/{self.proc.pid}/syscall"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with open(path) as f:
                    nr = f.read().split()[0]
            except (OSError, IndexError):  # no /proc here: a pause has to do
                nr = None
            if nr is None or platform.machine() not in _WAITING:
                time.sleep(0.5)
                return
            if nr in _WAITING[platform.machine()]:
                return
            time.sleep(0.01)
        raise AssertionError(f"the chat never waited for input:\n{self.screen}")

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        os.close(self.master)


def test_ctrl_c_stops_a_reply_and_ctrl_d_leaves(tmp_path):
    model = make_long_model(tmp_path / "long")
    t = Terminal("--model", model, "--backend", "numpy", "--temperature", "0", "-n", "3000", "-v")
    try:
        t.read_until(r"Ctrl-C stops a reply")
        t.read_until(r"> $")
        t.type("Tell me a long story\r")
        n = len(t.screen)
        t.read_until(r"(?s).{%d}" % (n + 40))  # the reply is streaming
        t.type("\x03")
        screen = t.read_until(r"\(stopped\)")
        t.read_until(r"\[prompt \d+ tokens, \d+ cached; \d+ generated")
        first = STATS.findall(t.screen)[0]
        assert int(first[2]) < 3000
        t.read_until(r"> $")
        t.wait_for_input()
        t.type("\x03")  # at the prompt: a fresh prompt, not an exit
        t.read_until(r"> (\^C)?\r?\n> $")  # the terminal may echo ^C, depending on who reads it
        t.type("Go on\r")
        n = len(t.screen)
        t.read_until(r"(?s).{%d}" % (n + 40))
        t.type("\x03")  # stop the second reply too
        t.read_until(r"(?s)\(stopped\).*\[prompt.*\(stopped\).*\[prompt.*> $")
        second = STATS.findall(t.screen)[1]
        assert int(second[2]) < 3000
        assert int(second[1]) > int(first[0])  # the first turn, stopped reply included, came from the cache
        t.type("\x04")  # Ctrl-D leaves
        assert t.proc.wait(30) == 0
        assert "Traceback" not in screen
    finally:
        t.close()
