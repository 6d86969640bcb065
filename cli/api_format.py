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


class Shape:
    """The JSON of one kind of answer; `chat` picks chat completions, else (text) completions."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
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

    def usage_chunk(self, usage: Usage) -> str:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return sse({**self._head(obj), "choices": [], "usage": usage_json(usage)})
