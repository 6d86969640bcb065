"""What o_proj folded into attention would give the small shapes: the step with each layer's attention and o_proj
replaced by dev/attn_oproj.cu (a block per query head, its head's W_o columns applied in the block), against the
step as it is. Two folds: "red" adds each block's results into x as they come (SUM_LAST 0), "sum last" leaves
them as partials that the last block adds in head order (SUM_LAST 1).

PYTHONPATH=. python3 dev/attn_oproj_ab.py [--rounds N] [shape ...]

Depth 0 only: the fold takes the one-split path, up to the rows whose K and V take 128 KiB. The sums run in
another order than o_proj's, so the logits are compared with a tolerance (max |difference| over max |logit|,
after 1 and 3 steps); "sum last" must also give the same bits twice. Then each graph is timed (64 replays,
median of 4) in turn, round after round.
"""

from __future__ import annotations

import sys
from pathlib import Path

import cupy as cp
import numpy as np

from dev.gemv_tail_probe import defines_of, is_bf16_gemv, relaunch, step_at
from dev.gemv_tickets_ab import logits_after, time_in_turn
from engine import bench as B
from graphs.graph import capture
from kernels.bandwidth import copy_bandwidth
from kernels.launch import Module
from kernels.tuning import AttnTuning

FOLD = Path(__file__).resolve().parent / "attn_oproj.cu"
TOLERANCE = 1e-3


def folded(launches, cfg, sum_last: bool):
    """The step's launches with attention + o_proj as one launch per layer, or None where a layer does not fit."""
    by_name = {launch.name: i for i, launch in enumerate(launches)}
    out, drop = list(launches), set()
    smem = cfg.hidden_size * (cfg.head_dim // 8 + 1) * 16
    partials = cp.zeros(cfg.num_heads * cfg.hidden_size, cp.float32)
    counts = cp.zeros(cfg.num_layers, cp.uint32)
    for layer in range(cfg.num_layers):
        a, o = by_name.get(f"layer{layer}.attn"), by_name.get(f"layer{layer}.o_proj")
        if a is None or o is None or not is_bf16_gemv(launches[o]) or launches[o]._values[3].value:
            return None  # no o_proj of its own, a block format, or a bias
        attn, oproj = launches[a], launches[o]
        mod = Module.load(FOLD, {**defines_of(attn.kernel.module), "SUM_LAST": int(sum_last)})
        extra = [oproj._values[0].value, oproj._values[4].value, cfg.hidden_size, partials,
                 int(counts.data.ptr) + 4 * layer]
        grid = (cfg.num_heads // cfg.num_kv_heads, cfg.num_kv_heads)  # a block per query head, no more
        launch = relaunch(attn, mod.function("attn_oproj", attn.sig + "PPiPP"), extra, grid=grid, smem=smem)
        launch.buffers = (partials, counts)  # kept alive with the launch
        out[a] = launch
        drop.add(o)
    return [launch for i, launch in enumerate(out) if i not in drop]


def main(argv):
    opts = {a: argv[i + 1] for i, a in enumerate(argv) if a == "--rounds"}
    rounds = int(opts.get("--rounds", 2))
    shapes = [a for a in argv if not a.startswith("--") and a not in opts.values()] or ["smollm2-135m", "qwen2.5-0.5b"]
    copy_gbs = copy_bandwidth(4 << 30, 10)
    print(f"copy bandwidth {copy_gbs:,.0f} GB/s", flush=True)
    failed = False
    for name in shapes:
        backend, launches = step_at(name, 0)
        cfg, s = backend.cfg, backend.stream
        if B.TG_TOKENS + B.WARMUP + 1 > AttnTuning().one_split_limit(cfg.head_dim):
            print(f"{name}: the bench's rows pass the one-split limit; skipped")
            continue
        folds = {"red": folded(launches, cfg, False), "sum last": folded(launches, cfg, True)}
        if folds["red"] is None:
            print(f"{name}: a layer's o_proj cannot be folded (block format, bias or none); skipped")
            continue
        cp.cuda.runtime.deviceSynchronize()  # the folds' zeroed buffers, before the capture's stream reads them
        graphs = {"step": capture(s, launches), **{v: capture(s, f) for v, f in folds.items()}}
        s.synchronize()
        for k in (1, 3):
            want = logits_after(backend, graphs["step"], 0, k).view(np.float32)
            for v in folds:
                got = logits_after(backend, graphs[v], 0, k)
                err = float(np.abs(got.view(np.float32) - want).max() / max(np.abs(want).max(), 1e-30))
                ok = bool(np.isfinite(got.view(np.float32)).all()) and err < TOLERANCE
                if v == "sum last":
                    same = np.array_equal(got, logits_after(backend, graphs[v], 0, k))
                    ok &= same
                failed |= not ok
                print(f"{name} {v:<8} logits after {k} step(s): max |difference| / max |logit| {err:.2e} "
                      f"({'within' if err < TOLERANCE else 'OUTSIDE'} {TOLERANCE:g})"
                      + (f"; run again: {'same bits' if same else 'DIFFER'}" if v == "sum last" else ""), flush=True)
        time_in_turn(name, backend, graphs, 0, rounds, copy_gbs)
        del backend, graphs
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
