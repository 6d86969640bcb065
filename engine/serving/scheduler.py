"""The order requests run in: a bounded first-in first-out queue."""

from __future__ import annotations

import threading
from collections import deque

from engine.errors import GDecodeError
from engine.serving.request import Request


class QueueFull(GDecodeError):
    """The queue holds its maximum of waiting requests."""


class Scheduler:
    """Waiting requests, oldest first; at most `max_waiting` of them (the running ones not counted)."""

    def __init__(self, max_waiting: int):
        if max_waiting < 1:
            raise GDecodeError(f"the queue must hold at least one request, got {max_waiting}")
        self.max_waiting = max_waiting
        self._queue: deque[Request] = deque()
        self._ready = threading.Condition()

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, req: Request) -> None:
        with self._ready:
            if len(self._queue) >= self.max_waiting:
                raise QueueFull(f"{len(self._queue)} requests are already waiting")
            self._queue.append(req)
            self._ready.notify()

    def pop(self, timeout: float) -> Request | None:
        """The oldest waiting request; None when none arrives within timeout seconds."""
        with self._ready:
            if not self._queue and not self._ready.wait(timeout):
                return None
            return self._queue.popleft() if self._queue else None

    def drain(self) -> list[Request]:
        """Remove and return every waiting request."""
        with self._ready:
            out = list(self._queue)
            self._queue.clear()
            return out
