"""The OpenAI-compatible HTTP API over a ServingEngine (FastAPI); all of the server's HTTP lives here."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import sys
import time
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest

from cli.api_format import Shape, sse
from cli.api_schema import ApiError, ChatRequest, CompletionRequest, check_common, messages_of, parse, sampling_params
from engine.errors import GDecodeError
from engine.serving import (
    Delta,
    Failed,
    Finished,
    PromptTooLong,
    QueueFull,
    Request,
    ServingEngine,
    ShuttingDown,
    check_prompt,
)

MAX_BODY = 10 * 2**20
DRAIN_MAX = 64 * 2**20
RETRY_AFTER_S = 1
DISCONNECT_POLL_S = 0.25
INLINE_TOKENIZE = 16384  # characters tokenized on the event loop itself (well under a millisecond)
WEB = Path(__file__).resolve().parent / "web"
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")
FAILED_STATUS = {"invalid": 400, "shutdown": 503, "internal": 500}
log = logging.getLogger("gdecode.serve")


class EventStream(StreamingResponse):
    """Server-sent events; `on_close` runs however the response ends (done, client gone, shutdown)."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        except OSError:
            pass  # the client went away mid-write
        finally:
            self.on_close()


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def read_json(request: HttpRequest) -> object:
    """The body as JSON; 413 past MAX_BODY bytes, 400 when it does not parse."""
    length = request.headers.get("content-length", "")
    declared = int(length) if length.isdigit() else 0
    body, seen = bytearray(), 0
    async for part in request.stream():
        seen += len(part)
        if seen <= MAX_BODY and declared <= MAX_BODY:
            body += part
        elif seen > DRAIN_MAX:
            break  # past this the client is cut off; up to it, it gets to read the answer
    if seen > MAX_BODY or declared > MAX_BODY:
        raise ApiError(413, f"the request body is larger than {MAX_BODY // 2**20} MB", code="request_too_large")
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({e})") from None
    except ValueError:  # the one other: int() of an integer longer than sys.get_int_max_str_digits()
        raise ApiError(400, f"a number in the request body is too long (over {sys.get_int_max_str_digits()} "
                       "digits)") from None
    # a \uD800-\uDFFF escape (or a UTF-16/32 body) may decode to a lone surrogate, which no text can hold
    if _SURROGATE.search(body) or b"\0" in body[:4]:
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(400, "the request body is not valid Unicode: a \\u escape is a lone UTF-16 surrogate "
                           "(\\uD800-\\uDFFF without its pair)") from None
    return data


def create_app(engine: ServingEngine, model_id: str) -> FastAPI:
    """The app for a started engine: /v1/models, /v1/completions, /v1/chat/completions, /health and /."""
    app = FastAPI(title="gdecode", docs_url=None, redoc_url=None, openapi_url=None)
    llm = engine.llm
    tok, ctx = llm.tokenizer, llm.max_context
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def _api_error(_, e: ApiError):
        return error_response(e)

    @app.exception_handler(HTTPException)
    async def _http_error(_, e: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return error_response(ApiError(e.status_code, str(e.detail), code=code))

    @app.exception_handler(Exception)
    async def _internal(_, e: Exception):
        log.exception("internal error")
        return error_response(ApiError(500, f"internal error: {type(e).__name__}", type="server_error"))

    @app.get("/health")
    async def health():
        if engine.stopping:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return {"status": "ok", "model": model_id, "waiting": len(engine.scheduler), "running": len(engine.running)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name != model_id:
            raise ApiError(404, f"the model '{name}' does not exist", "model", "model_not_found")
        return model_card()

    def model_card() -> dict:
        return {"id": model_id, "object": "model", "created": created, "owned_by": "gdecode", "max_model_len": ctx}

    @app.get("/", include_in_schema=False)
    async def index():
        return FileResponse(WEB / "index.html", media_type="text/html")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HttpRequest):
        arrived = time.perf_counter()
        req = parse("chat", await read_json(request))
        check_common(req, model_id)
        messages = messages_of(req)
        size = sum(len(m["content"]) for m in messages)
        ids = await encode(lambda: tok.encode_chat(messages, max_tokens=ctx), "messages", size)
        return await run(request, req, ids, "messages", arrived)

    @app.post("/v1/completions")
    async def completions(request: HttpRequest):
        arrived = time.perf_counter()
        req = parse("completion", await read_json(request))
        check_common(req, model_id)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            if min(prompt) < 0 or max(prompt) >= llm.cfg.vocab_size:
                raise ApiError(400, f"'prompt' holds a token id outside [0, {llm.cfg.vocab_size})", "prompt")
            return await run(request, req, list(prompt), "prompt", arrived)
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise ApiError(400, f"'prompt' must be one text; a batch of {len(prompt)} is not supported", "prompt")
            prompt = prompt[0]
        ids = await encode(lambda: tok.encode(prompt, max_tokens=ctx), "prompt", len(prompt))
        return await run(request, req, ids, "prompt", arrived)

    async def run(request: HttpRequest, req: ChatRequest | CompletionRequest, ids: list[int], what: str,
                  arrived: float):
        """Queue the request; `arrived` (when its handler began) starts the time to first token that
        usage and the log report, so that parsing and tokenizing count."""
        try:
            check_prompt(len(ids), ctx)
        except PromptTooLong as e:
            raise ApiError(400, str(e), what, "context_length_exceeded") from None
        except GDecodeError as e:
            raise ApiError(400, str(e), what) from None
        params = sampling_params(req, ctx - len(ids))
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emit(ev):
            try:
                loop.call_soon_threadsafe(events.put_nowait, ev)
            except RuntimeError:
                pass  # the event loop is gone: nobody is listening

        r = Request(ids, params, emit, reuse=req.cache_prompt, ignore_eos=req.ignore_eos, submitted=arrived)
        try:
            engine.submit(r)
        except QueueFull as e:
            raise ApiError(429, f"the server is busy ({e}); retry later", code="queue_full",
                           type="rate_limit_error", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except ShuttingDown as e:
            raise ApiError(503, str(e), code="shutting_down", type="server_error") from None
        shape = Shape(isinstance(req, ChatRequest), model_id, tok)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return EventStream(stream(events, shape, include_usage, r.id), on_close=r.cancel)
        return await whole(request, r, events, shape)

    return app


async def encode(fn, what: str, size: int) -> list[int]:
    """Tokenize (a long text on a worker thread, so that running streams go on); a prompt that cannot
    fit the context is refused before all of it is tokenized."""
    try:
        return fn() if size <= INLINE_TOKENIZE else await asyncio.to_thread(fn)
    except GDecodeError as e:
        code = "context_length_exceeded" if "context" in str(e) else None
        raise ApiError(400, str(e), what, code) from None


async def whole(request: HttpRequest, r: Request, events: asyncio.Queue, shape: Shape):
    text: list[str] = []
    logprobs = []
    while True:
        try:
            ev = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                r.cancel()
            continue
        if isinstance(ev, Delta):
            text.append(ev.text)
            if ev.logprobs is not None:
                logprobs.append(ev.logprobs)
        elif isinstance(ev, Finished):
            return shape.whole("".join(text), ev.reason, ev.usage, shape.logprobs(logprobs))
        elif isinstance(ev, Failed):
            kind = "server_error" if ev.kind != "invalid" else "invalid_request_error"
            return error_response(ApiError(FAILED_STATUS[ev.kind], ev.message, type=kind))


async def stream(events: asyncio.Queue, shape: Shape, include_usage: bool, req_id: int):
    """SSE chunks: the role, then text as it becomes final (whatever is ready goes out as one chunk),
    the finish reason, usage when asked for, and [DONE]. Logs (debug) how long the first text took
    from the engine to the socket."""
    yield shape.chunk(first=True)
    first_at = 0.0
    while True:
        batch = [await events.get()]
        while not events.empty():
            batch.append(events.get_nowait())
        deltas = [ev for ev in batch if isinstance(ev, Delta)]
        text = "".join(ev.text for ev in deltas)
        logprobs = shape.logprobs([ev.logprobs for ev in deltas if ev.logprobs is not None])
        if text or logprobs:
            yield shape.chunk(text, logprobs=logprobs)
            if not first_at and text:
                first_at = next(ev.at for ev in deltas if ev.text)
                log.debug("request %d: first text written %.2f ms after its token", req_id,
                          1e3 * (time.perf_counter() - first_at))
        last = batch[-1]
        if isinstance(last, Finished):
            yield shape.chunk(reason=last.reason)
            if include_usage:
                yield shape.usage_chunk(last.usage)
            break
        if isinstance(last, Failed):
            yield sse(ApiError(FAILED_STATUS[last.kind], last.message, type="server_error").body())
            break
    yield "data: [DONE]\n\n"
