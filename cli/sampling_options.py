"""The sampling options that `generate` and `chat` share, declared once."""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import typer

from engine.errors import BadSampling
from engine.sampling import SamplingParams

_P = SamplingParams
# SamplingParams field: (type, option), in --help order
OPTIONS: dict[str, tuple[type, Any]] = {
    "temperature": (float, typer.Option(_P.temperature, help="0 means greedy.")),
    "top_k": (int, typer.Option(_P.top_k, help="0 turns top-k off.")),
    "top_p": (float, typer.Option(_P.top_p, help="1.0 turns top-p off.")),
    "min_p": (float, typer.Option(_P.min_p, "--min-p", help="Keep tokens with p >= min_p * p_max; 0 turns it off.")),
    "repeat_penalty": (float, typer.Option(_P.repeat_penalty, "--repeat-penalty",
                                           help="Penalize the last --repeat-last-n tokens (llama.cpp); 1.0 is off.")),
    "repeat_last_n": (int, typer.Option(_P.repeat_last_n, "--repeat-last-n",
                                        help="Tokens the repeat penalty covers; 0 off, -1 the whole context.")),
    "presence_penalty": (float, typer.Option(_P.presence_penalty, "--presence-penalty",
                                             help="Subtract from tokens already generated (OpenAI); 0 is off.")),
    "frequency_penalty": (float, typer.Option(
        _P.frequency_penalty, "--frequency-penalty",
        help="Subtract per earlier occurrence in the output (OpenAI); 0 is off.")),
}


def sampling_options(command: Callable) -> Callable:
    """Put the shared sampling options where `command` declares its parameter `sampling`; the command
    gets their values back in `sampling`, a dict of SamplingParams fields."""
    sig = inspect.signature(command, eval_str=True)
    params: list[inspect.Parameter] = []
    for p in sig.parameters.values():
        if p.name == "sampling":
            params += [inspect.Parameter(n, p.kind, annotation=t, default=o) for n, (t, o) in OPTIONS.items()]
        else:
            params.append(p)

    @functools.wraps(command)
    def run(**kw):
        sampling = {n: kw.pop(n) for n in OPTIONS}
        return command(sampling=sampling, **kw)

    run.__signature__ = sig.replace(parameters=params)
    run.__annotations__ = {p.name: p.annotation for p in params}
    return run


def cli_params(**fields) -> SamplingParams:
    """SamplingParams from the command line: a bad value is reported by its option (--top-k, not top_k)."""
    try:
        return SamplingParams(**fields)
    except BadSampling as e:
        raise e.renamed("--" + e.field.replace("_", "-")) from None
