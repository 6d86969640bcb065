"""Streamed tok/s and time to first token through `gdecode serve` against the same model without HTTP.

    PYTHONPATH=. python dev/serve_bench.py --model models/smollm2-135m-instruct
    PYTHONPATH=. python dev/serve_bench.py --shape llama3-8b    # random weights, SmolLM2's tokenizer

A server process is started on a free loopback port. Inside it, before it serves, the baseline is
measured the way `gdecode generate` measures itself (the backend's token stream, detokenized, first
token to last; time to first token from the start of the request), greedy, EOS ignored. Then the
official `openai` client streams the same prompt (prefix reuse off, so both prefill the same
tokens): tok/s from the first content chunk to the last, time to first content chunk from the
call. Last, a 10-turn chat with prefix reuse on shows the last turn's time to first token beside
the first's. Targets: streamed tok/s >= 95% of the baseline, time to first token <= baseline + 2 ms.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle. " * 2


class TimedBackend:
    """A stand-in backend for timing the HTTP path alone: the first token `prefill_ms` after the request,
    then one every `step_ms`, sleeping (so without the interpreter lock, as a GPU wait is)."""

    name = "timed"

    def __init__(self, vocab: int, max_context: int, prefill_ms: float = 5.0, step_ms: float = 2.0):
        self.vocab, self.max_context = vocab, max_context
        self.prefill_s, self.step_s = prefill_ms / 1e3, step_ms / 1e3
        self.reused = 0

    def generate(self, ids, params, max_new_tokens: int, reuse: bool = False):
        time.sleep(self.prefill_s)
        for i in range(min(max_new_tokens, self.max_context - len(ids))):
            if i:
                time.sleep(self.step_s)
            yield 300 + i % 1000  # ordinary text tokens of SmolLM2's vocabulary


def load(args):
    from engine.llm import LLM

    if args.backend == "timed":
        from engine.llm import GenerationStats
        from engine.tokenizer import Tokenizer

        class TimedLLM(LLM):
            def __init__(self):
                self.tokenizer = Tokenizer.from_dir(args.model)
                self.backend = TimedBackend(self.tokenizer.vocab_size, args.max_context)
                self.stats = GenerationStats()
                self._warm_up_text()

        return TimedLLM()
    if args.shape is None:
        return LLM(args.model, backend=args.backend, max_context=args.max_context)
    from engine.backend_cuda import CudaBackend
    from engine.llm import GenerationStats
    from engine.shapes import SHAPES
    from engine.tokenizer import Tokenizer

    class RandomLLM(LLM):
        def __init__(self):  # random weights made on the device; the tokenizer only turns ids into text
            self.tokenizer = Tokenizer.from_dir(args.model)
            # the tokenizer's vocabulary, so that every sampled id has text to stream
            self.cfg = replace(SHAPES[args.shape], vocab_size=self.tokenizer.vocab_size)
            self.backend = CudaBackend(self.cfg, None, max_context=args.max_context)
            self.stats = GenerationStats()
            self._warm_up_text()  # as a loaded LLM does

    return RandomLLM()


def baseline(llm, messages, tokens: int, repeats: int) -> dict:
    """tok/s and ttft of the backend's stream, detokenized, as `gdecode generate` counts them (its time
    to first token runs from before the prompt is rendered and tokenized)."""
    from engine.sampling import SamplingParams
    from engine.tokenizer import StreamDecoder

    rates, ttfts = [], []
    for _ in range(repeats + 1):  # the first run warms up
        t0 = time.perf_counter()
        ids = llm.tokenizer.encode_chat(messages, max_tokens=llm.max_context)
        dec = StreamDecoder(llm.tokenizer, context=ids)
        stream = llm.backend.generate(ids, SamplingParams(temperature=0.0, max_new_tokens=tokens), tokens)
        t_first = None
        for tok in stream:
            dec.push(tok)
            if t_first is None:
                t_first = time.perf_counter()
        t_last = time.perf_counter()
        rates.append((tokens - 1) / (t_last - t_first))
        ttfts.append(t_first - t0)
    return {"tok_s": statistics.median(rates[1:]), "ttft_ms": 1e3 * statistics.median(ttfts[1:]),
            "first_ttft_ms": 1e3 * ttfts[0]}


CHAT_TURNS = 10


def turn_message(i: int) -> dict:
    return {"role": "user", "content": f"Turn {i}: tell me one more thing about lighthouses."}


def chat_probe(llm, tokens: int = 64) -> list[tuple[float, float, int, int]]:
    """The 10-turn chat without HTTP: per turn (ms to render and tokenize, ms from the token ids to
    the first token, prompt tokens, tokens taken from the cache)."""
    from engine.sampling import SamplingParams

    history = [{"role": "system", "content": "You are a helpful assistant."}]
    rows = []
    for i in range(CHAT_TURNS):
        history.append(turn_message(i))
        t0 = time.perf_counter()
        ids = llm.tokenizer.encode_chat(history)
        t1 = time.perf_counter()
        out = []
        for tok in llm.backend.generate(ids, SamplingParams(temperature=0.0, max_new_tokens=tokens), tokens,
                                        reuse=True):
            if not out:
                t2 = time.perf_counter()
            out.append(tok)
        rows.append((1e3 * (t1 - t0), 1e3 * (t2 - t1), len(ids), llm.backend.reused))
        history.append({"role": "assistant", "content": llm.tokenizer.decode(out)})
    return rows


def serve(args):
    import logging

    from engine.serving import ServingEngine

    # the engine logs each request's time to first token (from its arrival) and its time queued at INFO,
    # the HTTP side (debug) how long the first text took from the engine to the socket
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("gdecode.serve").setLevel(logging.DEBUG)

    def load_and_measure():
        llm = load(args)
        messages = [{"role": "user", "content": PROMPT}]
        ids = llm.tokenizer.encode_chat(messages)
        base = baseline(llm, messages, args.tokens, args.repeats)
        chat_probe(llm)  # warm-up
        Path(args.baseline_out).write_text(json.dumps({**base, "prompt_tokens": len(ids), "chat": chat_probe(llm)}))
        return llm

    import cli.serve

    if args.switch_interval:
        cli.serve.SWITCH_INTERVAL_S = args.switch_interval
    plain = args.stack == "plain"
    cli.serve.run_server(ServingEngine(load_and_measure), "bench", "127.0.0.1", args.port,
                         http="h11" if plain else "auto", loop="asyncio" if plain else "auto")


def streamed(client, messages, tokens: int, cache: bool) -> dict:
    t0 = time.perf_counter()
    stream = client.chat.completions.create(model="bench", messages=messages, max_tokens=tokens, temperature=0.0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True, "cache_prompt": cache})
    t_first = t_last = None
    text = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            t_last = time.perf_counter()
            t_first = t_first or t_last
            text.append(chunk.choices[0].delta.content)
        if chunk.usage:
            usage = chunk.usage
    n = usage.completion_tokens
    return {"tok_s": (n - 1) / (t_last - t_first), "ttft_ms": 1e3 * (t_first - t0), "tokens": n,
            "cached": usage.prompt_tokens_details.cached_tokens, "text": "".join(text)}


def raw_stream(port: int, messages, tokens: int) -> dict:
    """The same streamed request over a plain socket (no client library): ms from sending it to the
    first content chunk's bytes, and how long the request took to build and send."""
    import socket

    t0 = time.perf_counter()
    body = json.dumps({"model": "bench", "messages": messages, "max_tokens": tokens, "temperature": 0.0,
                       "stream": True, "ignore_eos": True, "cache_prompt": False}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t1 = time.perf_counter()
        sock.sendall(head + body)
        seen = b""
        while b'"content":"' not in seen.replace(b'"content":""', b""):
            part = sock.recv(65536)
            if not part:
                raise SystemExit("the server closed the stream before any content")
            seen += part
        t2 = time.perf_counter()
        while sock.recv(65536):
            pass
    return {"ttft_ms": 1e3 * (t2 - t1), "send_ms": 1e3 * (t1 - t0)}


def client_floor(repeats: int) -> float:
    """The openai client's own time to first content chunk (ms, median) against a canned loopback server
    that answers every request at once with a role chunk, a text chunk and the end."""
    import socket
    import threading

    import openai

    def chunk(delta: dict, reason=None) -> bytes:
        obj = {"id": "chatcmpl-0", "object": "chat.completion.chunk", "created": 0, "model": "bench",
               "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}
        event = f"data: {json.dumps(obj)}\n\n".encode()
        return b"%x\r\n%s\r\n" % (len(event), event)

    answer = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
              + chunk({"role": "assistant", "content": ""}) + chunk({"content": "Hi"}) + chunk({}, "length")
              + b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")

    def serve(conn):
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = b""
        while True:
            while b"\r\n\r\n" not in buf:
                if not (part := conn.recv(65536)):
                    return
                buf += part
            head, buf = buf.split(b"\r\n\r\n", 1)
            n = int(next(v for k, _, v in (ln.partition(b":") for ln in head.split(b"\r\n"))
                         if k.lower() == b"content-length"))
            while len(buf) < n:
                buf += conn.recv(65536)
            buf = buf[n:]
            conn.sendall(answer)

    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=lambda: [threading.Thread(target=serve, args=(listener.accept()[0],), daemon=True)
                                     .start() for _ in iter(int, 1)], daemon=True).start()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{listener.getsockname()[1]}/v1", api_key="unused",
                           max_retries=0)
    times = []
    for _ in range(10 * repeats + 10):
        t0 = time.perf_counter()
        for c in client.chat.completions.create(model="bench", messages=[{"role": "user", "content": PROMPT}],
                                                max_tokens=8, temperature=0.0, stream=True):
            if c.choices and c.choices[0].delta.content:
                times.append(1e3 * (time.perf_counter() - t0))
                break
    return statistics.median(times[10:])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    ap.add_argument("--shape", default=None, help="random weights of this shape (engine/shapes.py)")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-context", type=int, default=8192)
    ap.add_argument("--backend", default="cuda",
                    help="cuda | numpy (numpy: a dry run of the script) | timed (no model: tokens after fixed "
                         "sleeps, 5 ms to the first and 2 ms between, to time the HTTP path alone)")
    ap.add_argument("--stack", default="auto", choices=["auto", "plain"],
                    help="auto: uvicorn with httptools and uvloop; plain: h11 and asyncio's loop")
    ap.add_argument("--switch-interval", type=float, default=0.0, help="the server's (s; default: cli/serve.py's)")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--baseline-out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return serve(args)

    import tempfile

    from tests.serving import free_port

    out = Path(tempfile.mkdtemp()) / "baseline.json"
    port = free_port()
    cmd = [sys.executable, __file__, "--serve", "--port", str(port), "--baseline-out", str(out), "--model", args.model,
           "--tokens", str(args.tokens), "--repeats", str(args.repeats), "--max-context", str(args.max_context),
           "--backend", args.backend, "--stack", args.stack, "--switch-interval", str(args.switch_interval)]
    if args.shape:
        cmd += ["--shape", args.shape]
    log_path = out.with_name("serve.log")
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=log_path.open("w"))
    try:
        import openai

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=600)
        deadline = time.monotonic() + 900
        while True:
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("the server did not start") from None
                time.sleep(0.5)
        base = json.loads(out.read_text())
        msgs = [{"role": "user", "content": PROMPT}]
        runs = [streamed(client, msgs, args.tokens, cache=False) for _ in range(args.repeats + 1)][1:]
        tok_s = statistics.median(r["tok_s"] for r in runs)
        ttft = statistics.median(r["ttft_ms"] for r in runs)
        print(f"model: {args.shape or args.model}; prompt {base['prompt_tokens']} tokens, {args.tokens} generated, "
              f"median of {args.repeats}")
        print(f"{'':24}{'tok/s':>10}{'ttft ms':>10}")
        print(f"{'without HTTP':24}{base['tok_s']:>10.1f}{base['ttft_ms']:>10.2f}")
        print(f"{'streamed (openai)':24}{tok_s:>10.1f}{ttft:>10.2f}")
        def logged(what: str, last: int) -> list[float]:
            """The last `last` values (ms) the server logged after `what`."""
            return [float(m) for m in re.findall(what + r" ([0-9.]+) ms", log_path.read_text())][-last:]

        n = args.repeats
        print(f"in the server ({args.stack} stack): handler to first token {statistics.median(logged('ttft', n)):.2f} "
              f"ms, of which queued {statistics.median(logged('queued', n)):.2f} ms; first token to its text written "
              f"{statistics.median(logged('first text written', n)):.2f} ms")
        raw = [raw_stream(port, msgs, 8) for _ in range(args.repeats + 1)][1:]
        raw_ttft = statistics.median(r["ttft_ms"] for r in raw)
        print(f"{'streamed (raw socket)':24}{'':>10}{raw_ttft:>10.2f}   (new connection each; no client library)")
        floor = client_floor(args.repeats)
        print(f"{'openai client alone':24}{'':>10}{floor:>10.2f}   (a canned server that answers at once)")
        ratio, extra = tok_s / base["tok_s"], ttft - base["ttft_ms"]
        first = base["first_ttft_ms"] / base["ttft_ms"]
        print(f"first request after load: time to first token {base['first_ttft_ms']:.2f} ms, {first:.2f}x a later "
              f"one's (target <= 2x): {'PASS' if first <= 2 else 'FAIL'}")
        print(f"streamed/baseline tok/s {100 * ratio:.1f}% (target >= 95%): {'PASS' if ratio >= 0.95 else 'FAIL'}")
        print(f"added time to first token {extra:+.2f} ms (target <= 2 ms): {'PASS' if extra <= 2.0 else 'FAIL'}")
        history = [{"role": "system", "content": "You are a helpful assistant."}]
        turns = []
        for i in range(CHAT_TURNS):
            history.append(turn_message(i))
            r = streamed(client, history, 64, cache=True)
            history.append({"role": "assistant", "content": r["text"]})
            turns.append(r)
        print("10-turn chat with prefix reuse, time to first token per turn (ms): "
              + " ".join(f"{t['ttft_ms']:.1f}" for t in turns))
        print("cached prompt tokens per turn: " + " ".join(str(t["cached"]) for t in turns))
        print("  of which in the server, from its handler to the first token (ms): "
              + " ".join(f"{v:.1f}" for v in logged("ttft", CHAT_TURNS)))
        chat = base["chat"]
        print("the same chat without HTTP: render+tokenize ms " + " ".join(f"{r[0]:.1f}" for r in chat))
        print("  ids to first token ms " + " ".join(f"{r[1]:.1f}" for r in chat))
        print("  prompt/cached tokens " + " ".join(f"{r[2]}/{r[3]}" for r in chat))
    finally:
        proc.terminate()
        proc.wait(60)


if __name__ == "__main__":
    main()
