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
