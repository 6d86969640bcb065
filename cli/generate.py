from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Optional

import typer

from cli.main import app
from engine.errors import GDecodeError
from engine.llm import DEFAULT_MODEL, LLM
from engine.sampling import SamplingParams, resolve_seed

_P = SamplingParams


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="The prompt text, or - to read it from standard input."),
    model: Path = typer.Option(DEFAULT_MODEL, "--model", "-m", help="Hugging Face model directory or .gguf file."),
    max_new_tokens: int = typer.Option(_P.max_new_tokens, "--max-new-tokens", "-n", min=1),
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
    logprobs: Optional[int] = typer.Option(None, "--logprobs", help="Print each token's log-probability and the "
                                           "top N (0-20) as JSON lines on stderr."),
    seed: Optional[int] = typer.Option(None, help="Sampling seed; the same seed gives the same tokens (printed on "
                                       "stderr when not given)."),
    stop: list[str] = typer.Option([], "--stop", help="Stop when this text appears (repeatable)."),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the model's chat template."),
    system: Optional[str] = typer.Option(None, "--system", help="With --chat: a system message first."),
    backend: str = typer.Option("auto", help="auto | cuda | numpy"),
    max_context: Optional[int] = typer.Option(None, help="KV-cache length (default: the model's limit)."),
    no_graph: bool = typer.Option(False, "--no-graph", help="Launch the decode kernels eagerly (CUDA)."),
    quantize: Optional[str] = typer.Option(None, help="Quantize a bf16/fp16/fp32 model at load: q8_0 | q4_0."),
):
    """Generate text from PROMPT, streaming it to stdout; speed goes to stderr."""
    if system is not None and not chat:
        raise GDecodeError("--system needs --chat")
    if prompt == "-":
        prompt = sys.stdin.read()
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                            max_new_tokens=max_new_tokens, stop=tuple(stop), min_p=min_p,
                            repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n,
                            presence_penalty=presence_penalty, frequency_penalty=frequency_penalty, logprobs=logprobs)
    llm = LLM(model, backend=backend, max_context=max_context, use_graph=not no_graph, quantize=quantize)
    if seed is None:
        params = replace(params, seed=resolve_seed(params))
    shown = 0
    for piece in llm.generate(prompt, params, chat=chat, system=system):
        sys.stdout.write(piece)
        sys.stdout.flush()
        shown = _print_logprobs(llm, shown)
    _print_logprobs(llm, shown)
    sys.stdout.write("\n")
    if seed is None and not params.greedy:
        print(f"seed: {params.seed} (pass --seed {params.seed} to repeat this run)", file=sys.stderr)
    s = llm.stats
    if s.stop_reason == "context":
        print(f"stopped: reached the context limit of {llm.max_context} tokens", file=sys.stderr)
    print(f"[{llm.backend.name}] prompt {s.prompt_tokens} tokens, time to first token {s.ttft * 1e3:.1f} ms; "
          f"generated {s.new_tokens} tokens in {s.seconds:.2f} s, {s.tok_per_s:.1f} tok/s "
          f"(stop: {s.stop_reason})", file=sys.stderr)


def _print_logprobs(llm: LLM, shown: int) -> int:
    """One JSON line on stderr per generated token not shown yet; returns how many are shown."""
    decode = llm.tokenizer.decode
    for t in llm.logprobs[shown:]:
        top = [{"token": i, "text": decode([i]), "logprob": round(lp, 6)} for i, lp in t.top]
        print(json.dumps({"token": t.token, "text": decode([t.token]), "logprob": round(t.logprob, 6), "top": top},
                         ensure_ascii=False), file=sys.stderr)
    return len(llm.logprobs)
