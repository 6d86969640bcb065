from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from cli.main import app
from engine.errors import GDecodeError
from engine.llm import DEFAULT_MODEL, LLM
from engine.sampling import SamplingParams

_P = SamplingParams


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="The prompt text, or - to read it from standard input."),
    model: Path = typer.Option(DEFAULT_MODEL, "--model", "-m", help="Hugging Face model directory or .gguf file."),
    max_new_tokens: int = typer.Option(_P.max_new_tokens, "--max-new-tokens", "-n", min=1),
    temperature: float = typer.Option(_P.temperature, help="0 means greedy."),
    top_k: int = typer.Option(_P.top_k, help="0 turns top-k off."),
    top_p: float = typer.Option(_P.top_p, help="1.0 turns top-p off."),
    seed: Optional[int] = typer.Option(None, help="Sampling seed; the same seed gives the same tokens."),
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
                            max_new_tokens=max_new_tokens, stop=tuple(stop))
    llm = LLM(model, backend=backend, max_context=max_context, use_graph=not no_graph, quantize=quantize)
    for piece in llm.generate(prompt, params, chat=chat, system=system):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    s = llm.stats
    if s.stop_reason == "context":
        print(f"stopped: reached the context limit of {llm.max_context} tokens", file=sys.stderr)
    print(f"[{llm.backend.name}] prompt {s.prompt_tokens} tokens, time to first token {s.ttft * 1e3:.1f} ms; "
          f"generated {s.new_tokens} tokens in {s.seconds:.2f} s, {s.tok_per_s:.1f} tok/s "
          f"(stop: {s.stop_reason})", file=sys.stderr)
