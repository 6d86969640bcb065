"""A running request: its backend token stream turned into text, one token per step."""

from __future__ import annotations

import secrets
import time
from dataclasses import replace

from engine.errors import GDecodeError
from engine.llm import LLM, StopMatcher
from engine.serving.request import Delta, Finished, Request, Usage
from engine.tokenizer import StreamDecoder


class PromptTooLong(GDecodeError):
    """The prompt leaves no room in the context for a reply."""


def check_prompt(n_tokens: int, max_context: int) -> None:
    """Raise PromptTooLong unless a prompt of n_tokens leaves at least one position for the reply."""
    if n_tokens < 1:
        raise GDecodeError("the prompt is empty")
    if n_tokens >= max_context:
        over = n_tokens - max_context + 1
        raise PromptTooLong(f"the prompt is {n_tokens} tokens but the context holds {max_context} "
                            f"with at least one left for the reply: {over} token{'s' * (over != 1)} too many")


class Sequence:
    """Advances `req` on `llm`'s backend: EOS, stop strings, the token budget and the context limit
    end it exactly as `LLM.generate` would, and each step emits the text that became final."""

    def __init__(self, llm: LLM, req: Request):
        check_prompt(len(req.prompt), llm.max_context)
        params = req.params
        if params.seed is None:
            params = replace(params, seed=secrets.randbits(63))
        self.req, self.llm = req, llm
        self.budget = min(params.max_new_tokens, llm.max_context - len(req.prompt))
        self.decoder = StreamDecoder(llm.tokenizer, context=req.prompt)
        self.stops = StopMatcher(params.stop)
        self.eos = frozenset() if req.ignore_eos else frozenset(llm.tokenizer.eos_ids)
        self.want_logprobs = getattr(params, "logprobs", None) is not None
        self.tokens = llm.backend.generate(req.prompt, params, self.budget, reuse=req.reuse)
        self.generated = 0
        self.cached = 0
        self.t_first = self.t_last = 0.0
        self.done = False
        self.note = ""  # how it ended, for the log

    def step(self) -> None:
        """Run one token and emit it; emit Finished (and set done) when the request ends."""
        token = next(self.tokens)
        self.t_last = time.perf_counter()
        if self.generated == 0:
            self.t_first = self.t_last
            self.cached = getattr(self.llm.backend, "reused", 0)
        self.generated += 1
        if token in self.eos:
            return self.finish("stop")
        text, hit = self.stops.push(self.decoder.push(token))
        lp = getattr(self.llm.backend, "token_logprobs", None) if self.want_logprobs else None
        self.req.emit(Delta(text, token, lp, self.t_last))
        if hit:
            return self.finish("stop", flush=False)
        if self.generated >= self.budget:
            self.finish("length")

    def finish(self, reason: str, flush: bool = True) -> None:
        """End the request (reason: stop | length | abort), emitting any text still held back."""
        if self.done:
            return
        self.done = True
        self.note = self.note or reason
        self.tokens.close()
        if flush:
            text, _ = self.stops.push(self.decoder.flush(), final=True)
            if text:
                self.req.emit(Delta(text, -1))
        self.req.emit(Finished(reason, self.usage()))

    def usage(self) -> Usage:
        ttft = self.t_first - self.req.submitted if self.generated else 0.0
        queued = max(0.0, self.req.admitted - self.req.submitted) if self.req.admitted else 0.0
        return Usage(len(self.req.prompt), self.generated, self.cached, ttft, self.t_last - self.t_first, queued)
