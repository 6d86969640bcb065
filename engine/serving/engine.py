"""The serving engine: one loaded model, a scheduler, and a step loop on a thread of its own."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from engine.errors import GDecodeError
from engine.llm import LLM
from engine.serving.request import Failed, Finished, Request, Usage
from engine.serving.scheduler import Scheduler
from engine.serving.sequence import Sequence

log = logging.getLogger("gdecode.serve")

POLL_S = 0.1  # how often an idle step loop looks at the stop flag
MAX_RUNNING = 1  # sequences advanced together per step (batch 1 today)


class ShuttingDown(GDecodeError):
    """The engine takes no new requests."""


class ServingEngine:
    """Runs requests on one model, oldest first. `load` builds the LLM on the engine's own thread,
    so every backend call (a CUDA context is per thread) happens there; `submit` and `stop` may be
    called from any thread, `stop` even from a signal handler."""

    def __init__(self, load: Callable[[], LLM], max_waiting: int = 64):
        self.scheduler = Scheduler(max_waiting)
        self.llm: LLM | None = None
        self.running: list[Sequence] = []
        self._load = load
        self._stopping = False
        self._closed = False
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="gdecode-engine", daemon=True)

    def start(self) -> LLM:
        """Start the step loop; returns once the model is loaded (or raises what loading raised)."""
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        return self.llm

    def submit(self, req: Request) -> None:
        """Queue a request; raises QueueFull or ShuttingDown instead of queueing it."""
        with self._lock:
            if self._stopping or self._closed:
                raise ShuttingDown("the server is shutting down")
            self.scheduler.add(req)

    def stop(self) -> None:
        """Begin shutting down: the running request ends (reason abort), waiting ones fail. Takes no lock."""
        self._stopping = True

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the step loop to end; True if it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def stopping(self) -> bool:
        return self._stopping

    def _main(self) -> None:
        try:
            self.llm = self._load()
        except BaseException as e:  # handed to start()'s caller
            self._error = e
            return
        finally:
            self._ready.set()
        while not self._stopping:
            self.step()
        with self._lock:
            self._closed = True
        for seq in self.running:
            seq.note = "stopped by shutdown"
            self._end(seq, "abort")
        self.running.clear()
        for req in self.scheduler.drain():
            req.emit(Failed("shutdown", "the server is shutting down"))

    def step(self) -> None:
        """Admit waiting requests while there is room, then advance every running sequence one token."""
        while len(self.running) < MAX_RUNNING:
            req = self.scheduler.pop(0.0 if self.running else POLL_S)
            if req is None:
                break
            self._admit(req)
        for seq in list(self.running):
            if seq.req.cancelled or self._stopping:
                seq.note = "cancelled" if seq.req.cancelled else "stopped by shutdown"
                self._end(seq, "abort")
                continue
            try:
                seq.step()
            except StopIteration:
                seq.finish("length")
            except GDecodeError as e:  # e.g. non-finite logits: the request fails, the engine goes on
                log.warning("request %d failed: %s", seq.req.id, e)
                self._fail(seq, e)
                continue
            except Exception as e:
                log.exception("request %d failed", seq.req.id)
                self._fail(seq, e)
                continue
            if seq.done:
                self._retire(seq)

    def _admit(self, req: Request) -> None:
        req.admitted = time.perf_counter()
        if req.cancelled:
            req.emit(Finished("abort", Usage(len(req.prompt), 0, 0, 0.0, 0.0)))
            return
        try:
            self.running.append(Sequence(self.llm, req))
        except GDecodeError as e:
            req.emit(Failed("invalid", str(e)))

    def _end(self, seq: Sequence, reason: str) -> None:
        try:
            seq.finish(reason)
        except Exception as e:
            log.exception("request %d failed while ending", seq.req.id)
            self._fail(seq, e)
            return
        self._retire(seq)

    def _fail(self, seq: Sequence, e: Exception) -> None:
        seq.done = True
        try:
            seq.tokens.close()
        finally:
            self.running.remove(seq)
            seq.req.emit(Failed("internal", str(e) if isinstance(e, GDecodeError) else f"{type(e).__name__}: {e}"))

    def _retire(self, seq: Sequence) -> None:
        self.running.remove(seq)
        u = seq.usage()
        rate = (u.completion_tokens - 1) / u.seconds if u.completion_tokens > 1 and u.seconds > 0 else 0.0
        log.info("request %d %s: prompt %d tokens (%d cached), %d generated, ttft %.2f ms (queued %.2f ms), "
                 "%.1f tok/s", seq.req.id, seq.note, u.prompt_tokens, u.cached_tokens, u.completion_tokens,
                 u.ttft * 1e3, u.queued * 1e3, rate)
