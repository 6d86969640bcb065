"""A real `gdecode serve` process on a free loopback port, for the server, web and GPU tests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from tests.tiny import EOS, make_tiny_model

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONIOENCODING": "utf-8", "PYTHONUNBUFFERED": "1"}


def gdecode_cmd(*args) -> list[str]:
    return [sys.executable, "-c", "from cli.main import main; main()", *map(str, args)]


def in_threads(fn, n: int, timeout: float) -> None:
    """fn(0) .. fn(n - 1) at the same time, one thread each; waits up to `timeout` for each thread."""
    threads = [threading.Thread(target=fn, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_long_model(dir: Path, context: int = 4096) -> Path:
    """A tiny model with room for long replies whose greedy decoding never picks EOS
    (its lm_head row is zero, so its logit is 0 while the best of the others is positive)."""
    make_tiny_model(dir, "llama", tied=False, heads=4, kv_heads=2, seed=3)
    cfg = json.loads((dir / "config.json").read_text())
    cfg["max_position_embeddings"] = context
    (dir / "config.json").write_text(json.dumps(cfg))
    path = next(dir.glob("*.safetensors"))
    tensors = load_file(path)
    tensors["lm_head.weight"] = tensors["lm_head.weight"].copy()
    tensors["lm_head.weight"][EOS] = np.zeros_like(tensors["lm_head.weight"][EOS])
    save_file(tensors, path, metadata={"format": "pt"})
    return dir


class Server:
    """`gdecode serve` on 127.0.0.1:<free port>; its combined output goes to `log_path`."""

    def __init__(self, model: Path, log_path: Path, *args, backend: str = "numpy", timeout: float = 180.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")
        cmd = gdecode_cmd("serve", "--model", model, "--backend", backend, "--port", self.port, *args)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start:\n{self.log()}")
            time.sleep(0.2)

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, **kw)

    def post(self, path: str, body: bytes | str | dict, timeout: float = 60.0) -> tuple[int, dict, object]:
        """(status, JSON body, headers) of a raw POST, error statuses included."""
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        data = data.encode() if isinstance(data, str) else data
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read()), r.headers
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read()), e.headers

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def bad_bodies(model: str, context: int) -> list[tuple[object, int]]:
    """Bad chat requests to `model` (served with `context` positions) and the status each must get."""
    msg = [{"role": "user", "content": "x"}]
    return [
        ('{"messages": [', 400),
        ({"model": model, "messages": []}, 400),
        ({"model": model, "messages": [{"role": "robot", "content": "x"}]}, 400),
        ({"model": model, "messages": msg, "max_tokens": 0}, 400),
        ({"model": model, "messages": msg, "n": 4}, 400),
        ({"model": "other", "messages": msg}, 404),
        ({"model": model, "messages": msg, "temperature": "warm"}, 400),
        ({"model": model, "messages": [{"role": "user", "content": "fox " * (context + 100)}]}, 400),
    ]


def rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def soak(server: Server, model: str, context: int, clients: int = 8, each: int = 25) -> dict:
    """clients x each requests at once, each client a random mix of whole and streamed chats, text
    completions, streams dropped after a few chunks, and bad requests. Asserts that every good request
    completes, every bad one gets its OpenAI error, the server still answers after, and its memory is
    flat (what the requests after the first quarter added is small); returns the RSS samples (KiB)."""
    import random

    words = "the quick brown fox jumps over lazy dog hello world tiny model token once upon a time".split()
    bad = bad_bodies(model, context)
    total = clients * each
    done, lock, failures, rss = [0], threading.Lock(), [], {}

    def finished():
        with lock:
            done[0] += 1
            if done[0] in (total // 4, total):
                rss[done[0]] = rss_kib(server.proc.pid)

    def client(k: int):
        rng = random.Random(k)
        c = server.client(timeout=120)
        for _ in range(each):
            kind = rng.choice(["whole", "stream", "completion", "disconnect", "bad"])
            msgs = [{"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(1, 30)))}]
            kw = dict(max_tokens=rng.randint(1, 60), temperature=rng.choice([0.0, 0.7, 1.2]), seed=rng.randint(0, 99))
            try:
                if kind == "whole":
                    r = c.chat.completions.create(model=model, messages=msgs, **kw)
                    assert r.choices[0].finish_reason in ("stop", "length")
                    assert r.usage.completion_tokens <= kw["max_tokens"]
                elif kind == "stream":
                    chunks = list(c.chat.completions.create(model=model, messages=msgs, stream=True,
                                                            stream_options={"include_usage": True}, **kw))
                    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
                    assert chunks[-1].usage.completion_tokens <= kw["max_tokens"]
                elif kind == "completion":
                    r = c.completions.create(model=model, prompt=msgs[0]["content"], **kw)
                    assert r.choices[0].finish_reason in ("stop", "length")
                elif kind == "disconnect":
                    stream = c.chat.completions.create(model=model, messages=msgs, stream=True,
                                                       **{**kw, "max_tokens": 300})
                    stop_at = rng.randint(0, 5)
                    for i, _ in enumerate(stream):
                        if i == stop_at:
                            break
                    stream.close()
                else:
                    body, status = rng.choice(bad)
                    got, answer, _ = server.post("/v1/chat/completions", body)
                    assert got == status and set(answer["error"]) == {"message", "type", "param", "code"}, answer
            except Exception as e:  # collected: a thread's assert would not fail the test
                failures.append(f"{kind}: {type(e).__name__}: {e}")
            finished()

    in_threads(client, clients, 600)
    assert not failures, failures[:5]
    assert done[0] == total
    last = server.client().chat.completions.create(model=model, messages=[{"role": "user", "content": "still there?"}],
                                                   max_tokens=2)
    assert last.usage.completion_tokens <= 2
    # memory is flat: what the last three quarters of the requests added over the first quarter is small
    assert rss[total] - rss[total // 4] < 32 * 1024, rss
    return rss
