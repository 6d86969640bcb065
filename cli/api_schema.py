"""OpenAI request bodies: parsing, checking, and the mapping onto SamplingParams."""

from __future__ import annotations

import dataclasses
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, ValidationError

from engine.errors import BadSampling, GDecodeError
from engine.sampling import SamplingParams

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MAX_LOGPROBS = 20


class ApiError(Exception):
    """An error answer: HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Body(BaseModel):
    # unknown fields are ignored, as OpenAI's server does; types are not coerced ("5" is not 5)
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class ContentPart(_Body):
    type: str
    text: Union[str, None] = None


class Message(_Body):
    role: str
    content: Union[str, list[ContentPart], None] = None


class _Sampling(_Body):
    model: Union[str, None] = None
    max_tokens: Union[int, None] = None
    temperature: Union[float, None] = None
    top_p: Union[float, None] = None
    top_k: Union[int, None] = None
    min_p: Union[float, None] = None
    seed: Union[int, None] = None
    stop: Union[str, list[str], None] = None
    n: Union[int, None] = None
    repetition_penalty: Union[float, None] = None
    presence_penalty: Union[float, None] = None
    frequency_penalty: Union[float, None] = None
    stream: Union[bool, None] = None
    stream_options: Union[StreamOptions, None] = None
    logit_bias: Union[dict, None] = None  # refused unless empty (check_common): it would change the reply
    ignore_eos: bool = False  # vLLM's and llama-server's extension: EOS does not end the reply
    cache_prompt: bool = True  # llama-server's extension: reuse the KV cache's matching prefix


class ChatRequest(_Sampling):
    messages: list[Message]
    max_completion_tokens: Union[int, None] = None
    logprobs: Union[bool, None] = None
    top_logprobs: Union[int, None] = None
    # refused when they ask for something (check_common): ignored, they would change the reply unannounced
    response_format: Union[dict, None] = None
    tools: Union[list, None] = None


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int]]
    logprobs: Union[int, None] = None
    echo: Union[bool, None] = None
    suffix: Union[str, None] = None


_FIELDS = set(ChatRequest.model_fields) | set(CompletionRequest.model_fields) | set(Message.model_fields) \
    | set(ContentPart.model_fields) | set(StreamOptions.model_fields)


def parse(kind: Literal["chat", "completion"], data: object) -> ChatRequest | CompletionRequest:
    """Validate a decoded JSON body; ApiError 400 names the first bad field."""
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    cls = ChatRequest if kind == "chat" else CompletionRequest
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = ""
        for part in err["loc"]:
            if isinstance(part, int):
                param += f"[{part}]"
            elif part in _FIELDS:
                param += f".{part}" if param else part
        if err["type"] == "missing":
            raise ApiError(400, f"'{param}' is a required field", param) from None
        raise ApiError(400, f"'{param}': {err['msg'].lower()} (got {_show(data, err['loc'])})", param) from None


def _show(data, loc) -> str:
    x = data
    for part in loc:
        if isinstance(x, dict) and part in x:
            x = x[part]
        elif isinstance(x, list) and isinstance(part, int) and part < len(x):
            x = x[part]
    text = repr(x)
    return text if len(text) <= 40 else text[:37] + "..."


def messages_of(req: ChatRequest) -> list[dict]:
    """The chat messages as the template takes them; unknown roles and empty lists are errors."""
    if not req.messages:
        raise ApiError(400, "'messages' must hold at least one message", "messages")
    out = []
    for i, m in enumerate(req.messages):
        role = ROLES.get(m.role)
        if role is None:
            raise ApiError(400, f"messages[{i}].role {m.role!r} is not one of {', '.join(ROLES)}",
                           f"messages[{i}].role")
        if isinstance(m.content, list):
            if any(p.type != "text" or p.text is None for p in m.content):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported",
                               f"messages[{i}].content")
            content = "".join(p.text for p in m.content)
        else:
            content = m.content or ""
        out.append({"role": role, "content": content})
    return out


def check_common(req: ChatRequest | CompletionRequest, model_id: str) -> None:
    """Model name (404) and the fields every request shares."""
    if req.model not in (None, "", model_id):
        raise ApiError(404, f"the model '{req.model}' does not exist; this server serves '{model_id}'",
                       "model", "model_not_found")
    if req.n is not None and req.n != 1:
        raise ApiError(400, f"'n' must be 1: more than one choice per request is not supported (got {req.n})",
                       "n")
    if req.logit_bias:
        raise ApiError(400, "'logit_bias' is not supported", "logit_bias")
    if isinstance(req, ChatRequest):
        kind = (req.response_format or {}).get("type", "text")
        if kind != "text":
            raise ApiError(400, f"'response_format' of type {kind!r} is not supported: replies are plain text",
                           "response_format")
        if req.tools:
            raise ApiError(400, "'tools' (function calling) is not supported", "tools")
    if isinstance(req, CompletionRequest):
        if req.echo:
            raise ApiError(400, "'echo' is not supported", "echo")
        if req.suffix:
            raise ApiError(400, "'suffix' is not supported", "suffix")


def max_new_tokens(req: ChatRequest | CompletionRequest) -> int | None:
    names = ("max_completion_tokens", "max_tokens") if isinstance(req, ChatRequest) else ("max_tokens",)
    for name in names:
        value = getattr(req, name)
        if value is not None:
            if value < 1:
                raise ApiError(400, f"'{name}' must be at least 1, got {value}", name)
            return value
    return None


def logprobs_of(req: ChatRequest | CompletionRequest) -> int | None:
    """The top-n count the sampler reports per token, or None."""
    if isinstance(req, ChatRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
        n = (req.top_logprobs or 0) if req.logprobs else None
        param = "top_logprobs"
    else:
        n, param = req.logprobs, "logprobs"
    if n is not None and not 0 <= n <= MAX_LOGPROBS:
        raise ApiError(400, f"'{param}' must be between 0 and {MAX_LOGPROBS}, got {n}", param)
    return n


def sampling_params(req: ChatRequest | CompletionRequest, default_max: int) -> SamplingParams:
    """SamplingParams for the request; fields left out keep SamplingParams' defaults, as `generate` does.
    A sampler option this build lacks is an error only when asked for with a non-default value."""
    have = {f.name for f in dataclasses.fields(SamplingParams)}
    kw: dict = {"max_new_tokens": max_new_tokens(req) or default_max}
    top_k = req.top_k
    if top_k == -1:  # vLLM's spelling of "off"
        top_k = 0
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    # (request field, SamplingParams field, value, the value that means "off")
    fields = (
        ("temperature", "temperature", req.temperature, None),
        ("top_p", "top_p", req.top_p, None),
        ("top_k", "top_k", top_k, None),
        ("seed", "seed", req.seed, None),
        ("stop", "stop", tuple(s for s in stop if s), ()),
        ("min_p", "min_p", req.min_p, 0.0),
        ("repetition_penalty", "repeat_penalty", req.repetition_penalty, 1.0),
        ("presence_penalty", "presence_penalty", req.presence_penalty, 0.0),
        ("frequency_penalty", "frequency_penalty", req.frequency_penalty, 0.0),
        ("top_logprobs" if isinstance(req, ChatRequest) else "logprobs", "logprobs", logprobs_of(req), None),
    )
    for param, name, value, off in fields:
        if value is None or (value == off and off is not None and name not in have):
            continue
        if name not in have:
            raise ApiError(400, f"'{param}' is not supported by this build", param)
        kw[name] = value
    try:
        return SamplingParams(**kw)
    except BadSampling as e:
        # the request's own name for the field: 'repetition_penalty', not repeat_penalty
        param = {name: param for param, name, _, _ in fields}.get(e.field, e.field)
        raise ApiError(400, str(e.renamed(f"'{param}'")), param) from None
    except GDecodeError as e:
        raise ApiError(400, str(e)) from None
