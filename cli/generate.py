from __future__ import annotations

import json
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Optional

import typer

from cli.main import app, silence
from cli.sampling_options import cli_params, sampling_options
from engine.errors import GDecodeError
from engine.llm import DEFAULT_MODEL, LLM
from engine.sampling import SamplingParams, resolve_seed

_P = SamplingParams
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "0": "\0", "\\": "\\", "'": "'", '"': '"'}
_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|.)", re.DOTALL)


def unescape(text: str) -> str:
    r"""Backslash escapes as a shell's $'...' reads them: \n \t \r \0 \\ \' \" \xHH \uHHHH; a backslash
    before anything else stays as written."""

    def one(m: re.Match) -> str:
        e = m.group(1)
        if len(e) > 1:
            return chr(int(e[1:], 16))
        return _ESCAPES.get(e, m.group(0))

    return _ESCAPE.sub(one, text)


def valid_text(text: str, what: str) -> str:
    """Arguments that are not UTF-8 reach Python as lone surrogates: read them as U+FFFD, with a notice."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        _say(f"warning: {what} is not valid UTF-8; invalid bytes read as U+FFFD")
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _read_stdin(limit: int) -> str:
    """The prompt from standard input: at most `limit` bytes are read, and invalid UTF-8 becomes U+FFFD."""
    if sys.stdin is None:
        raise GDecodeError("prompt '-': there is no standard input to read it from")
    data = sys.stdin.buffer.read(limit + 1)
    if len(data) > limit:
        raise GDecodeError(f"the prompt on standard input is over {limit:,} bytes, more than the context can hold")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        _say("warning: the prompt on standard input is not valid UTF-8; invalid bytes read as U+FFFD")
        return data.decode("utf-8", "replace")


def _say(msg: str) -> None:
    try:
        print(msg, file=sys.stderr, flush=True)
    except BrokenPipeError:
        silence(sys.stderr)


def _write(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()


@app.command()
@sampling_options
def generate(
    prompt: str = typer.Argument(..., help="The prompt text, or - to read it from standard input."),
    model: Path = typer.Option(DEFAULT_MODEL, "--model", "-m", help="Hugging Face model directory or .gguf file."),
    max_new_tokens: int = typer.Option(_P.max_new_tokens, "--max-new-tokens", "-n",
                                       help="Generate at most this many tokens (>= 1)."),
    sampling: dict = None,  # the shared sampling options (cli/sampling_options.py)
    logprobs: Optional[int] = typer.Option(None, "--logprobs", help="Print each token's log-probability and the "
                                           "top N (0-20) as JSON lines on stderr."),
    seed: Optional[int] = typer.Option(None, help="Sampling seed; the same seed gives the same tokens (printed on "
                                       "stderr when not given)."),
    stop: list[str] = typer.Option([], "--stop", metavar="<text>",
                                   help=r"Stop when this text appears (repeatable). Backslash escapes "
                                        r"are read: \n newline, \t tab, \\ backslash, \xHH, \uHHHH."),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the model's chat template."),
    system: Optional[str] = typer.Option(None, "--system", help="With --chat: a system message first."),
    backend: str = typer.Option("auto", help="auto | cuda | numpy"),
    max_context: Optional[int] = typer.Option(None, help="KV-cache length, at most the model's limit "
                                                         "(default: the model's limit; numpy caps it at 8192)."),
    no_graph: bool = typer.Option(False, "--no-graph", help="Launch the decode kernels eagerly (CUDA)."),
    quantize: Optional[str] = typer.Option(None, help="Quantize a bf16/fp16/fp32 model at load: q8_0 | q4_0."),
):
    """Generate text from PROMPT, streaming it to stdout; speed goes to stderr.

    Ctrl-C stops it with the stats so far (exit status 130)."""
    if system is not None and not chat:
        raise GDecodeError("--system needs --chat")
    stops = tuple(unescape(valid_text(s, "--stop")) for s in stop)
    params = cli_params(seed=seed, max_new_tokens=max_new_tokens, stop=stops, logprobs=logprobs, **sampling)
    if system is not None:
        system = valid_text(system, "--system")
    llm = LLM(model, backend=backend, max_context=max_context, use_graph=not no_graph, quantize=quantize)
    prompt = _read_stdin(llm.max_prompt_bytes) if prompt == "-" else valid_text(prompt, "the prompt")
    if seed is None:
        params = replace(params, seed=resolve_seed(params))
    shown_seed = None if seed is not None or params.greedy else params.seed
    pieces = llm.generate(prompt, params, chat=chat, system=system)
    shown = 0
    try:
        for piece in pieces:
            _write(piece)
            shown = _print_logprobs(llm, shown)
        _print_logprobs(llm, shown)
        _write("\n")
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly
        silence(sys.stdout)
        pieces.close()
        llm.stats.stop_reason = "closed"
    except KeyboardInterrupt:
        pieces.close()
        llm.stats.stop_reason = "interrupted"
        _report(llm, shown_seed)
        raise
    _report(llm, shown_seed)


def _print_logprobs(llm: LLM, shown: int) -> int:
    """One JSON line on stderr per generated token not shown yet; returns how many are shown."""
    decode = llm.tokenizer.decode
    for t in llm.logprobs[shown:]:
        top = [{"token": i, "text": decode([i]), "logprob": round(lp, 6)} for i, lp in t.top]
        _say(json.dumps({"token": t.token, "text": decode([t.token]), "logprob": round(t.logprob, 6), "top": top},
                        ensure_ascii=False))
    return len(llm.logprobs)


def _report(llm: LLM, seed: int | None = None) -> None:
    """The stats line on stderr (and the seed drawn for this run, when none was given)."""
    s = llm.stats
    if s.stop_reason == "interrupted":
        try:
            _write("\n")
        except BrokenPipeError:
            silence(sys.stdout)
    if s.stop_reason == "context":
        _say(f"stopped: reached the context limit of {llm.max_context} tokens")
    _say(f"[{llm.backend.name}] prompt {s.prompt_tokens} tokens, time to first token {s.ttft * 1e3:.1f} ms; "
         f"generated {s.new_tokens} tokens in {s.seconds:.2f} s, {s.tok_per_s:.1f} tok/s "
         f"(stop: {s.stop_reason})")
    if seed is not None:
        _say(f"seed: {seed} (pass --seed {seed} to repeat this run)")
