"""OpenAI response bodies: completions and chat completions, whole and as stream chunks."""

from __future__ import annotations

import json
import secrets
import time

from engine.serving import Usage


def usage_json(u: Usage) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _lp(x: float) -> float:
    return max(x, -9999.0)  # as OpenAI's API writes a log-probability of zero mass (JSON has no -inf)


class Shape:
    """The JSON of one kind of answer; `chat` picks chat completions, else (text) completions.
    `tokenizer` spells the tokens of log-probabilities."""

    def __init__(self, chat: bool, model: str, tokenizer=None):
        self.chat, self.model, self.tokenizer = chat, model, tokenizer
        self.offset = 0  # completions: where the next token's text starts
        self.id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, text: str, reason: str, usage: Usage, logprobs=None) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                      "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}
        return {**self._head(self.object), "choices": [choice], "usage": usage_json(usage)}

    def chunk(self, text: str | None = None, reason: str | None = None, logprobs=None, first: bool = False) -> str:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else ({} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": reason}
            obj = "text_completion"
        return sse({**self._head(obj), "choices": [choice], "usage": None})

    def logprobs(self, items: list) -> dict | None:
        """The log-probabilities of tokens (engine.sampling.TokenLogprobs) as the answer spells them."""
        if not items:
            return None
        spell = self._spell
        if self.chat:
            def entry(token, lp):
                text = spell(token)
                return {"token": text, "logprob": _lp(lp), "bytes": list(text.encode("utf-8"))}

            return {"content": [{**entry(t.token, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top]}
                                for t in items], "refusal": None}
        tokens = [spell(t.token) for t in items]
        offsets = []
        for text in tokens:
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": [_lp(t.logprob) for t in items],
                "top_logprobs": [{spell(i): _lp(lp) for i, lp in t.top} for t in items], "text_offset": offsets}

    def _spell(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def usage_chunk(self, usage: Usage) -> str:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return sse({**self._head(obj), "choices": [], "usage": usage_json(usage)})
