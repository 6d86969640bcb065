from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from cli.main import app
from engine.errors import GDecodeError


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise GDecodeError(f"{what}: expected comma-separated integers, got {text!r}") from None
    if any(v < 0 for v in values):
        raise GDecodeError(f"{what}: values must not be negative")
    return values


@app.command()
def bench(
    shape: str = typer.Option("llama3-8b", help="Named model shape with random weights made on the device."),
    quant: str = typer.Option("bf16", "--quant", help="Weight format of the random shape: bf16, a ggml type "
                              "(q8_0, q4_0, q4_1, q5_0, q5_1, q2_k .. q6_k) or llama.cpp's q4_k_m / q5_k_m mix."),
    model: Optional[Path] = typer.Option(None, "--model", "-m", help="Benchmark a model folder or .gguf file."),
    tests: str = typer.Option("pp512,tg128", help="Comma list of pp512 and tg128."),
    depth: str = typer.Option("0", help="Tokens already in the KV cache, comma list (e.g. 0,2048,8192,32768)."),
    splits: str = typer.Option("", help="Attention split counts to sweep, comma list (default: chosen from the GPU)."),
    no_graph: bool = typer.Option(False, "--no-graph", help="Launch the same kernels eagerly, no graph replay."),
    repeats: int = typer.Option(3, min=3, help="Timed repeats per test after warm-up; the median is shown."),
    breakdown: bool = typer.Option(False, help="Also time each launch kind of one decode step."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    sample: bool = typer.Option(False, "--sample", help="Also time tg128 sampled (defaults, top-p, top-k, min-p, "
                                "penalties) next to greedy, their runs taken in turn."),
):
    """Batch-1 prefill (pp512) and decode (tg128 at depth) speed, with achieved GB/s vs device copy bandwidth."""
    from rich.console import Console
    from rich.progress import Progress

    from engine import bench as B
    from engine.loader import load_config
    from engine.shapes import shape as named_shape

    wanted = [t.strip() for t in tests.split(",") if t.strip()]
    bad = [t for t in wanted if t not in ("pp512", "tg128")]
    if bad or not wanted:
        raise GDecodeError(f"--tests: unknown test {', '.join(bad) or '(none)'} (choose from pp512, tg128)")
    depths = _ints(depth, "--depth") or [0]
    split_list = _ints(splits, "--splits") or [None]
    if any(s is not None and s < 1 for s in split_list):
        raise GDecodeError("--splits: values must be at least 1")
    cfg = load_config(model) if model is not None else named_shape(shape)
    from graphs.quant_weights import PRESETS

    if quant != "bf16" and quant not in PRESETS:
        raise GDecodeError(f"--quant: unknown format {quant!r} (choose from bf16, {', '.join(PRESETS)})")
    if model is not None and quant != "bf16":
        raise GDecodeError("--quant sets the format of a random --shape; a --model runs with its own tensor types")
    need = max(depths) + B.PP_TOKENS + B.TG_TOKENS + B.WARMUP + 1
    if need > cfg.max_position_embeddings:
        raise GDecodeError(f"--depth {max(depths)} leaves no room for the test in the model's context of "
                           f"{cfg.max_position_embeddings} tokens")

    from kernels.cuda import gpu_available

    if not gpu_available():
        raise GDecodeError("gdecode bench needs a CUDA GPU, and none was found")
    from engine.backend_cuda import CudaBackend
    from kernels.bandwidth import copy_bandwidth
    from kernels.tuning import Tuning

    err = Console(stderr=True)
    weights = None
    if model is not None:
        from engine.loader import load_model

        weights = load_model(model, tokenizer=False).weights
    copy_gbs = copy_bandwidth(4 << 30, 10)
    results, kinds = [], []
    steps = len(split_list) * len(depths) * len(wanted)
    with Progress(console=err, transient=True) as progress:
        task = progress.add_task("loading", total=steps)
        for s in split_list:
            backend = CudaBackend(cfg, weights, max_context=need, tuning=Tuning(splits=s), use_graph=not no_graph,
                                  random_quant=quant)
            weight_gb = backend.weights.step_bytes() / 1e9
            B.fill_cache(backend)
            for d in depths:
                progress.update(task, description=f"prefilling {d} tokens of depth")
                B.fill_depth(backend, d)
                for t in wanted:
                    progress.update(task, description=f"{t} @ depth {d}, splits {backend.attn_splits}")
                    if t == "pp512":
                        results.append(B.bench_pp(backend, d, repeats))
                    else:
                        configs = {"greedy": None, **(B.SAMPLED if sample else {})}
                        results += B.bench_tg_set(backend, d, repeats, not no_graph, copy_gbs, configs)
                    progress.advance(task)
            if breakdown:
                kinds = B.breakdown(backend, depths[-1])
            del backend
    name = str(model) if model is not None else shape if quant == "bf16" else f"{shape} {quant}"
    if as_json:
        json.dump({"model": name, "copy_gb_s": copy_gbs, "weight_gb": weight_gb, "results": [r.row() for r in results],
                   "breakdown": kinds}, sys.stdout, indent=1)
        print()
        return
    out = Console()
    out.print(f"{name}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_heads}/{cfg.num_kv_heads} heads, "
              f"vocab {cfg.vocab_size}; {weight_gb:.2f} GB of weights read per token; device copy bandwidth "
              f"{copy_gbs:,.0f} GB/s (4 GiB D2D, read + write)")
    out.print(results_table(results))
    if kinds:
        out.print(breakdown_table(kinds, depths[-1]))


def _table(*headers: str, title: str | None = None):
    """A table whose cells fold onto a second line in a narrow terminal instead of losing digits to an
    ellipsis; without vertical rules, so that the bench's tables fit 80 columns whole."""
    from rich import box
    from rich.table import Table

    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for h in headers:
        table.add_column(h, overflow="fold", justify="left" if h in ("test", "mode", "sampling", "kernel") else "right")
    return table


def results_table(results):
    table = _table("test", "mode", "sampling", "splits", "tok/s", "ms/token", "GB/s", "% copy")
    for r in results:
        table.add_row(r.test, r.mode, r.sampling if r.test.startswith("tg") else "", str(r.splits),
                      f"{r.tok_s:,.1f}", f"{r.ms_per_token:.3f}",
                      "" if r.gb_s is None else f"{r.gb_s:,.0f}", "" if r.pct_copy is None else f"{r.pct_copy:.1f}")
    return table


def breakdown_table(kinds: list[dict], depth: int):
    table = _table("kernel", "launches", "ms/step", "us/launch", "GB/s", "share %",
                   title=f"one eager decode step at depth {depth}")
    for k in kinds:
        table.add_row(k["kernel"], str(k["launches"]), f"{k['ms']:.3f}", f"{k['us_per_launch']:.1f}",
                      f"{k['gb_s']:,.0f}", f"{k['share']:.1f}")
    return table
