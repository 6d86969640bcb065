from __future__ import annotations

import queue
import signal
import sys
from pathlib import Path
from typing import Optional

import typer

from cli.main import app
from engine.errors import GDecodeError
from engine.llm import DEFAULT_MODEL, LLM
from engine.sampling import SamplingParams
from engine.serving import Delta, Failed, Finished, Request, ServingEngine, Usage, check_prompt

_P = SamplingParams
HELP = "/clear starts over, /exit or Ctrl-D leaves, Ctrl-C stops a reply"


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _reply(engine: ServingEngine, ids: list[int], params: SamplingParams) -> tuple[str, str, Usage | None]:
    """Stream one reply to stdout; Ctrl-C cancels it. Returns (text, finish reason, usage)."""
    events: queue.Queue = queue.Queue()
    req = Request(ids, params, events.put)
    engine.submit(req)
    old = signal.signal(signal.SIGINT, lambda *_: req.cancel())
    text: list[str] = []
    try:
        while True:
            ev = events.get()
            if isinstance(ev, Delta):
                text.append(ev.text)
                sys.stdout.write(ev.text)
                sys.stdout.flush()
            elif isinstance(ev, Finished):
                return "".join(text), ("stopped" if req.cancelled else ev.reason), ev.usage
            elif isinstance(ev, Failed):
                raise GDecodeError(ev.message)
    finally:
        signal.signal(signal.SIGINT, old)
        sys.stdout.write("\n")
        sys.stdout.flush()


def _read(prompt: str) -> str | None:
    """One line of input; None at end of input. Ctrl-C at the prompt just asks again."""
    while True:
        try:
            return input(prompt)
        except EOFError:
            return None
        except KeyboardInterrupt:
            sys.stdout.write("\n")


@app.command()
def chat(
    model: Path = typer.Option(DEFAULT_MODEL, "--model", "-m", help="Hugging Face model directory or .gguf file."),
    system: Optional[str] = typer.Option(None, "--system", help="A system message that starts the chat."),
    max_new_tokens: int = typer.Option(_P.max_new_tokens, "--max-new-tokens", "-n", min=1,
                                       help="Tokens per reply at most."),
    temperature: float = typer.Option(_P.temperature, help="0 means greedy."),
    top_k: int = typer.Option(_P.top_k, help="0 turns top-k off."),
    top_p: float = typer.Option(_P.top_p, help="1.0 turns top-p off."),
    min_p: float = typer.Option(_P.min_p, "--min-p", help="Keep tokens with p >= min_p * p_max; 0 turns it off."),
    repeat_penalty: float = typer.Option(_P.repeat_penalty, "--repeat-penalty",
                                         help="Penalize the last --repeat-last-n tokens (llama.cpp); 1.0 is off."),
    repeat_last_n: int = typer.Option(_P.repeat_last_n, "--repeat-last-n",
                                      help="Tokens the repeat penalty covers; 0 off, -1 the whole context."),
    presence_penalty: float = typer.Option(_P.presence_penalty, "--presence-penalty",
                                           help="Subtract from tokens already generated (OpenAI); 0 is off."),
    frequency_penalty: float = typer.Option(_P.frequency_penalty, "--frequency-penalty",
                                            help="Subtract per earlier occurrence in the output (OpenAI); 0 is off."),
    seed: Optional[int] = typer.Option(None, help="Sampling seed; the same seed gives the same replies."),
    backend: str = typer.Option("auto", help="auto | cuda | numpy"),
    max_context: Optional[int] = typer.Option(None, help="KV-cache length (default: the model's limit)."),
    no_graph: bool = typer.Option(False, "--no-graph", help="Launch the decode kernels eagerly (CUDA)."),
    quantize: Optional[str] = typer.Option(None, help="Quantize a bf16/fp16/fp32 model at load: q8_0 | q4_0."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Tokens, cache reuse and speed after each reply."),
):
    """Chat with the model in the terminal. The conversation stays in the KV cache between turns,
    so each turn prefills only its new tokens."""
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                            max_new_tokens=max_new_tokens, min_p=min_p, repeat_penalty=repeat_penalty,
                            repeat_last_n=repeat_last_n, presence_penalty=presence_penalty,
                            frequency_penalty=frequency_penalty)
    engine = ServingEngine(lambda: LLM(model, backend=backend, max_context=max_context, use_graph=not no_graph,
                                       quantize=quantize),
                           max_waiting=1)
    llm = engine.start()
    if llm.tokenizer.chat_template is None:
        raise GDecodeError(f"{model}: the model has no chat template")
    tty = sys.stdin.isatty()
    if tty:
        import readline  # noqa: F401  (line editing and history for input())

        _say(f"chatting with {Path(model).resolve().name} ({llm.backend.name}); {HELP}")
    start = [{"role": "system", "content": system}] if system is not None else []
    history = list(start)
    try:
        while (line := _read("> " if tty else "")) is not None:
            cmd = line.strip()
            if cmd in ("/exit", "/quit"):
                break
            if cmd == "/clear":
                history = list(start)
                _say("(conversation cleared)")
                continue
            if cmd.startswith("/"):
                _say(f"unknown command {cmd.split()[0]}: {HELP}")
                continue
            if not cmd:
                continue
            turn = [*history, {"role": "user", "content": line}]
            try:
                ids = llm.tokenizer.encode_chat(turn, max_tokens=llm.max_context)
                check_prompt(len(ids), llm.max_context)
            except GDecodeError as e:
                _say(f"error: {e}; /clear starts over")
                continue
            text, reason, usage = _reply(engine, ids, params)
            history = [*turn, {"role": "assistant", "content": text}]
            if reason == "stopped":
                _say("(stopped)")
            elif reason == "length":
                _say(f"(the reply reached its limit of {usage.completion_tokens} tokens)")
            if verbose and usage is not None:
                rate = (usage.completion_tokens - 1) / usage.seconds if usage.seconds > 0 else 0.0
                _say(f"[prompt {usage.prompt_tokens} tokens, {usage.cached_tokens} cached; "
                     f"{usage.completion_tokens} generated, time to first token {usage.ttft * 1e3:.1f} ms, "
                     f"{rate:.1f} tok/s]")
    finally:
        engine.stop()
        engine.join(10.0)
