"""A request to the serving engine and the events it sends back while it runs."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.sampling import SamplingParams

_ids = itertools.count(1)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens whose K/V came from the cache, not from prefill
    ttft: float  # seconds from submit to the first token
    seconds: float  # first token to last
    queued: float = 0.0  # seconds from submit until the engine took the request up (part of ttft)


@dataclass(frozen=True)
class Delta:
    """New text (possibly empty while a stop string or a split character is pending) and its token."""

    text: str
    token: int
    logprobs: object = None  # per-token sampler results, when the request asked for them
    at: float = 0.0  # when the engine had the token (perf_counter)


@dataclass(frozen=True)
class Finished:
    """The last event of a request that ran. reason: stop (EOS or a stop string) | length | abort."""

    reason: str
    usage: Usage


@dataclass(frozen=True)
class Failed:
    """The last event of a request that could not run. kind: invalid | shutdown | internal."""

    kind: str
    message: str


Event = Delta | Finished | Failed


@dataclass
class Request:
    """One generation: prompt token ids and sampling parameters in, events out through `emit`.

    `emit` is called from the engine's thread, in order, and ends with one Finished or Failed.
    """

    prompt: list[int]
    params: SamplingParams
    emit: Callable[[Event], None]
    reuse: bool = True  # start from the KV cache's longest matching prefix
    ignore_eos: bool = False
    id: int = field(default_factory=lambda: next(_ids))
    submitted: float = field(default_factory=time.perf_counter)
    admitted: float = 0.0  # when the engine took it up (perf_counter), 0 before
    _cancel: threading.Event = field(default_factory=threading.Event, repr=False)

    def cancel(self) -> None:
        """Stop at the next token (safe from any thread); a request not yet started never starts."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()
