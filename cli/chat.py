from __future__ import annotations

import logging
import queue
import signal
import sys
from pathlib import Path
from typing import Optional

import typer

from cli.generate import valid_text
from cli.main import app
from cli.sampling_options import cli_params, sampling_options
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
    """One line of input (invalid UTF-8 read as U+FFFD); None at end of input. Ctrl-C at the prompt
    just asks again."""
    while True:
        try:
            return valid_text(input(prompt), "the message")
        except EOFError:
            return None
        except KeyboardInterrupt:
            sys.stdout.write("\n")


@app.command()
@sampling_options
def chat(
    model: Path = typer.Option(DEFAULT_MODEL, "--model", "-m", help="Hugging Face model directory or .gguf file."),
    system: Optional[str] = typer.Option(None, "--system", help="A system message that starts the chat."),
    max_new_tokens: int = typer.Option(_P.max_new_tokens, "--max-new-tokens", "-n", help="Tokens per reply at most."),
    sampling: dict = None,  # the shared sampling options (cli/sampling_options.py)
    seed: Optional[int] = typer.Option(None, help="Sampling seed; the same seed gives the same replies."),
    backend: str = typer.Option("auto", help="auto | cuda | numpy"),
    max_context: Optional[int] = typer.Option(None, help="KV-cache length (default: the model's limit)."),
    no_graph: bool = typer.Option(False, "--no-graph", help="Launch the decode kernels eagerly (CUDA)."),
    quantize: Optional[str] = typer.Option(None, help="Quantize a bf16/fp16/fp32 model at load: q8_0 | q4_0."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Tokens, cache reuse and speed after each reply."),
):
    """Chat with the model in the terminal; each turn prefills only its new tokens.

    The conversation stays in the KV cache between turns."""
    params = cli_params(seed=seed, max_new_tokens=max_new_tokens, **sampling)
    # a reply that fails ends chat with its own error line: the engine's warning would repeat it
    logging.getLogger("gdecode.serve").setLevel(logging.ERROR)
    engine = ServingEngine(lambda: LLM(model, backend=backend, max_context=max_context, use_graph=not no_graph,
                                       quantize=quantize),
                           max_waiting=1)
    llm = engine.start()
    if llm.tokenizer.chat_template is None:
        raise GDecodeError(f"{model}: the model has no chat template")
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="surrogateescape")  # invalid bytes reach _read, not a decode error
    tty = sys.stdin.isatty()
    if tty:
        import readline  # noqa: F401  (line editing and history for input())

        _say(f"chatting with {Path(model).resolve().name} ({llm.backend.name}); {HELP}")
    start = [{"role": "system", "content": valid_text(system, "--system")}] if system is not None else []
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
