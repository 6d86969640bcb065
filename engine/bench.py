"""Batch-1 speed measurement: pp (prompt), tg (generation) at depth, per-kernel breakdown."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from engine.config import ModelConfig
from engine.sampling import SamplingParams
from graphs.decode import Launches
from kernels.numerics import active_splits
from kernels.tuning import AttnTuning

TG_TOKENS = 128
PP_TOKENS = 512
WARMUP = 8


@dataclass
class Result:
    test: str  # pp512 | tg128 | tg128@8192
    mode: str  # graph | eager | prefill | replay
    splits: int
    tok_s: float
    ms_per_token: float
    gb_s: float | None  # bytes the step must read / time
    pct_copy: float | None  # gb_s as % of the device copy bandwidth
    sampling: str = "greedy"  # tg: greedy or a SAMPLED configuration

    def row(self) -> dict:
        return asdict(self)


class Timer:
    """CUDA events around work queued on one stream; milliseconds."""

    def __init__(self, stream):
        import cupy as cp

        self.stream = stream
        self.start, self.end = cp.cuda.Event(), cp.cuda.Event()

    def __call__(self, work: Callable[[], None]) -> float:
        import cupy as cp

        self.start.record(self.stream)
        work()
        self.end.record(self.stream)
        self.end.synchronize()
        return cp.cuda.get_elapsed_time(self.start, self.end)


def fill_cache(backend, seed: int = 1) -> None:
    """Random K/V everywhere, so attention at depth reads real-looking values."""
    backend.bufs.fill_cache_random(seed, backend.stream)
    backend.stream.synchronize()


def fill_depth(backend, depth: int, seed: int = 2) -> None:
    """Put `depth` real tokens in the cache through the batched prefill (random ids), when there is one."""
    if depth == 0 or backend.prefill is None:
        return
    ids = np.random.default_rng(seed).integers(0, backend.cfg.vocab_size, depth).tolist()
    backend.prefill.run(ids)
    backend.stream.synchronize()


# the sampled decoding configurations `bench --sample` times next to greedy (random weights give flat
# logits, the sampler's hardest case)
SAMPLED = {
    "defaults": SamplingParams(),
    "top-p": SamplingParams(top_k=0, top_p=0.95),
    "top-k": SamplingParams(top_k=40, top_p=1.0),
    "min-p": SamplingParams(top_k=0, top_p=1.0, min_p=0.05),
    "penalties": SamplingParams(repeat_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5),
}


def set_position(backend, depth: int, prompt_tokens: int = 1, params: SamplingParams | None = None) -> None:
    """Continue as if `depth` tokens were already cached; the next prompt_tokens - 1 steps read the
    prompt buffer, the rest sample with `params` (default greedy)."""
    backend.bufs.write_state(backend.stream, [1] * (depth + prompt_tokens), params, seed=1, pos=depth)


def step_bytes(backend, n_cached: int) -> int:
    """Bytes one decode step reads: the weights as stored on the device (block formats at their own
    size), the embedding's one row, and n_cached bf16 K/V rows."""
    return backend.weights.step_bytes() + n_cached * backend.cfg.kv_bytes_per_token(2)


def bench_tg(backend, depth: int, repeats: int, graph: bool, copy_gbs: float,
             params: SamplingParams | None = None, sampling: str = "greedy") -> Result:
    return bench_tg_set(backend, depth, repeats, graph, copy_gbs, {sampling: params})[0]


def bench_tg_set(backend, depth: int, repeats: int, graph: bool, copy_gbs: float,
                 configs: dict[str, SamplingParams | None]) -> list[Result]:
    """tg128 of each sampling configuration (None: greedy), their runs taken in turn, repeat after repeat,
    so that a drift of the GPU's clocks over the run weighs on every configuration alike."""
    run = backend.step if graph else backend.step.eager
    timer = Timer(backend.stream)

    def tokens(n):
        for _ in range(n):
            run()

    times = {label: [] for label in configs}
    for params in configs.values():
        set_position(backend, depth, params=params)
        timer(lambda: tokens(WARMUP))
    for _ in range(repeats):
        for label, params in configs.items():
            set_position(backend, depth, params=params)
            times[label].append(timer(lambda: tokens(TG_TOKENS)))
    return [_tg_result(backend, depth, graph, copy_gbs, times[label], label) for label in configs]


def _tg_result(backend, depth: int, graph: bool, copy_gbs: float, times: list[float], sampling: str) -> Result:
    ms = statistics.median(times) / TG_TOKENS
    nbytes = step_bytes(backend, depth + TG_TOKENS // 2 + 1)
    gbs = nbytes / (ms * 1e-3) / 1e9
    name = f"tg{TG_TOKENS}" + (f"@{depth}" if depth else "")
    return Result(name, "graph" if graph else "eager", backend.attn_splits, 1e3 / ms, ms, gbs,
                  100 * gbs / copy_gbs, sampling)


def bench_pp(backend, depth: int, repeats: int) -> Result:
    """Prompt processing of PP_TOKENS tokens after `depth` cached ones (batched prefill when available)."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, backend.cfg.vocab_size, PP_TOKENS).tolist()
    timer = Timer(backend.stream)
    prefill = backend.prefill
    if prefill is not None:
        mode = "prefill"

        def work():
            prefill.run(ids, start=depth)
    else:
        mode = "replay"  # one decode-step replay per prompt token

        def work():
            for _ in ids:
                backend.step()

    def prepare():
        if prefill is None:
            set_position(backend, depth, PP_TOKENS)

    prepare()
    timer(work)
    times = []
    for _ in range(repeats):
        prepare()
        times.append(timer(work))
    ms = statistics.median(times)
    name = f"pp{PP_TOKENS}" + (f"@{depth}" if depth else "")
    return Result(name, mode, backend.attn_splits, PP_TOKENS / (ms * 1e-3), ms / PP_TOKENS, None, None)


def kind_bytes(cfg: ModelConfig, n_cached: int, splits: int, attn: AttnTuning) -> dict[str, int]:
    """Bytes each launch kind of the step reads + writes (summed over layers), with n_cached cache rows."""
    h, q, kv, i, L = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size, cfg.num_layers
    active = active_splits(n_cached, splits, attn, cfg.head_dim)
    # the partials of the active splits, written and read back by the merging block (none for one split)
    partials = 0 if active == 1 else 2 * cfg.num_heads * active * (cfg.head_dim + 2) * 4
    return {
        "embed": 2 * h + 4 * h,
        "qkv_proj": L * (2 * (q + 2 * kv) * h + 4 * (q + 2 * kv)),
        "rope_kv_append": L * (4 * (q + 2 * kv) + 2 * 2 * kv),
        "attn": L * (2 * 2 * kv * n_cached + 4 * q + partials + 4 * q),
        "o_proj": L * 2 * h * q,
        "gate_up": L * 2 * 2 * i * h,
        "down_proj": L * 2 * h * i,
        "lm_head": 2 * cfg.vocab_size * h + 4 * cfg.vocab_size,
        "sample": 8 * cfg.vocab_size,
    }


def breakdown(backend, depth: int, repeats: int = 5) -> list[dict]:
    """Median time per launch kind (the launch names without their layer) for one eager decode step at
    `depth`, sorted by time."""
    import cupy as cp

    cfg, s = backend.cfg, backend.stream
    launches = backend.step.launches
    kinds = [Launches.kind(launch.name) for launch in launches]
    events = [cp.cuda.Event() for _ in range(len(launches) + 1)]
    per_kind: dict[str, list[float]] = {}
    for r in range(repeats + 1):
        set_position(backend, depth)
        events[0].record(s)
        for j, launch in enumerate(launches):
            launch(s)
            events[j + 1].record(s)
        events[-1].synchronize()
        if r == 0:
            continue  # warm-up
        totals: dict[str, float] = {}
        for j, kind in enumerate(kinds):
            totals[kind] = totals.get(kind, 0.0) + cp.cuda.get_elapsed_time(events[j], events[j + 1])
        for kind, t in totals.items():
            per_kind.setdefault(kind, []).append(t)
    nbytes = kind_bytes(cfg, depth + 1, backend.attn_splits, backend.tuning.attn)
    w = backend.weights  # the projections read their matrices as stored (block formats at their size)
    for kind, field in (("qkv_proj", "wqkv"), ("o_proj", "wo"), ("gate_up", "w_gate_up"), ("down_proj", "w_down")):
        nbytes[kind] = sum(int(getattr(lw, field).nbytes) for lw in w.layers)
    nbytes["lm_head"] = int(w.lm_head.nbytes) + 4 * cfg.vocab_size
    count = {k: kinds.count(k) for k in set(kinds)}
    rows = []
    for kind, ts in per_kind.items():
        ms = statistics.median(ts)
        rows.append({"kernel": kind, "launches": count[kind], "ms": ms, "us_per_launch": 1e3 * ms / count[kind],
                     "gb_s": nbytes[kind] / (ms * 1e-3) / 1e9})
    total = sum(r["ms"] for r in rows)
    for r in rows:
        r["share"] = 100 * r["ms"] / total
    return sorted(rows, key=lambda r: -r["ms"])
