"""gdecode bench: argument errors on any machine, and a real run where a GPU is present."""

import json

import pytest

from engine.bench import TG_TOKENS, kind_bytes
from engine.shapes import SHAPES, decode_bytes, shape
from graphs.decode import STEP_KINDS
from kernels.tuning import AttnTuning, Tuning
from tests.test_cli import assert_one_line_error, gdecode


def test_llama3_8b_roofline_matches_peers():
    # PEERS: ~285 tok/s at 4,278 GB/s for the 8B shape at short context
    assert 4278e9 / decode_bytes(SHAPES["llama3-8b"], 1) == pytest.approx(285, abs=1)


def test_breakdown_bytes_cover_the_step():
    from graphs.decode import STEP_KINDS

    cfg = shape("qwen2.5-0.5b")
    attn = AttnTuning(min_chunk=64, one_split_rows=100)
    per_kind = kind_bytes(cfg, 1, 32, attn)
    assert set(per_kind) == set(STEP_KINDS), "every launch kind of the step has a byte count"
    weights = sum(per_kind[k] for k in ("qkv_proj", "o_proj", "gate_up", "down_proj", "lm_head"))
    assert weights == pytest.approx(decode_bytes(cfg, 0), rel=1e-3)
    # attention reads the K/V rows, plus the partials of the active splits once there is more than one:
    # none up to 100 rows (one split), then two splits of at least 64 rows
    kv_row = 2 * 2 * cfg.kv_size * cfg.num_layers
    one_split = kind_bytes(cfg, 100, 32, attn)["attn"]
    assert one_split - per_kind["attn"] == 99 * kv_row
    partials = 2 * cfg.num_heads * 2 * (cfg.head_dim + 2) * 4 * cfg.num_layers
    assert kind_bytes(cfg, 101, 32, attn)["attn"] - one_split == kv_row + partials


@pytest.mark.parametrize("args, needle", [
    (["--shape", "gpt5"], "unknown shape"),
    (["--depth", "200000"], "--depth"),
    (["--tests", "tg999"], "tg999"),
    (["--depth", "1,x"], "--depth"),
])
def test_bad_arguments(args, needle):
    assert_one_line_error(gdecode("bench", *args), needle)


def test_no_gpu_is_a_clear_error():
    from kernels.cuda import gpu_available

    if gpu_available():
        pytest.skip("a GPU is present")
    assert_one_line_error(gdecode("bench", "--shape", "smollm2-135m"), "GPU")


def step_bytes(cfg, n_cached: int) -> int:
    """What the device step reads of a bf16 llama shape: bf16 matrices, the RMSNorm weights as f32
    (2 bytes more each than decode_bytes counts), one embedding row, and n_cached K/V rows."""
    assert cfg.arch == "llama"  # no biases or q/k norms to add
    norms = (2 * cfg.num_layers + 1) * cfg.hidden_size
    return decode_bytes(cfg, n_cached) + 2 * norms + 2 * cfg.hidden_size


@pytest.mark.gpu
def test_bench_json_fields_agree():
    r = gdecode("bench", "--shape", "smollm2-135m", "--depth", "0,600", "--json", "--breakdown")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    cfg, copy = shape("smollm2-135m"), out["copy_gb_s"]
    assert out["model"] == "smollm2-135m" and copy > 100
    rows = {x["test"]: x for x in out["results"]}
    assert set(rows) == {"pp512", "tg128", "pp512@600", "tg128@600"}
    splits = {x["splits"] for x in out["results"]}
    assert len(splits) == 1 and splits.pop() >= 1
    for name, x in rows.items():
        depth = int(name.partition("@")[2] or 0)
        assert x["tok_s"] > 0 and x["tok_s"] * x["ms_per_token"] == pytest.approx(1e3, rel=1e-9), name
        if name.startswith("tg"):
            # bytes at the mean nkv of the 128 steps / time per token; % of the same run's copy bandwidth
            want = step_bytes(cfg, depth + TG_TOKENS // 2 + 1) / (x["ms_per_token"] * 1e-3) / 1e9
            assert x["mode"] == "graph" and x["gb_s"] == pytest.approx(want, rel=1e-9), name
            assert x["pct_copy"] == pytest.approx(100 * x["gb_s"] / copy, rel=1e-9), name
        else:
            assert x["mode"] in ("prefill", "replay") and x["gb_s"] is None and x["pct_copy"] is None, name
    # the breakdown: one eager step at the last depth, every launch of it counted once
    kinds = out["breakdown"]
    once = {"embed", "lm_head", "sample"}
    counts = {k["kernel"]: k["launches"] for k in kinds}
    assert {"embed", "qkv_proj", "attn", "o_proj", "gate_up", "down_proj", "lm_head", "sample"} <= set(counts)
    assert set(counts) <= set(STEP_KINDS)
    assert all(n == (1 if kind in once else cfg.num_layers) for kind, n in counts.items()), counts
    nbytes = kind_bytes(cfg, 600 + 1, rows["tg128"]["splits"], Tuning().attn)
    # the projections count their bf16 matrices as stored (what a block format would read instead)
    h, q, kv, i, L = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size, cfg.num_layers
    nbytes.update(qkv_proj=L * 2 * (q + 2 * kv) * h, o_proj=L * 2 * h * q, gate_up=L * 2 * 2 * i * h,
                  down_proj=L * 2 * h * i)
    for k in kinds:
        assert k["ms"] > 0 and k["us_per_launch"] == pytest.approx(1e3 * k["ms"] / k["launches"], rel=1e-9)
        assert k["gb_s"] == pytest.approx(nbytes[k["kernel"]] / (k["ms"] * 1e-3) / 1e9, rel=1e-9)
    assert sum(k["share"] for k in kinds) == pytest.approx(100, rel=1e-9)
    assert [k["ms"] for k in kinds] == sorted((k["ms"] for k in kinds), reverse=True)


@pytest.mark.gpu
def test_bench_sample_times_every_configuration_next_to_greedy():
    r = gdecode("bench", "--shape", "smollm2-135m", "--tests", "tg128", "--sample", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["results"]
    assert [x["sampling"] for x in rows] == ["greedy", "defaults", "top-p", "top-k", "min-p", "penalties"]
    assert all(x["test"] == "tg128" and x["mode"] == "graph" and x["tok_s"] > 0 for x in rows)


def test_bench_tables_keep_every_digit_in_80_columns():
    from rich.console import Console

    from cli.bench import breakdown_table, results_table
    from engine.bench import Result

    rows = [Result("pp512@32768", "prefill", 33, 275223.4, 0.0036, None, None, "greedy"),
            Result("tg128@32768", "graph", 33, 1874.6, 0.5335, 1854.2, 43.2, "penalties")]
    kinds = [{"kernel": "attn_partial", "launches": 24, "ms": 0.325, "us_per_launch": 13.5, "gb_s": 12346.0,
              "share": 28.8}]
    for table, cells in ((results_table(rows), ["pp512@32768", "275,223.4", "tg128@32768", "penalties",
                                                 "1,874.6", "0.533", "1,854", "43.2", "% copy"]),
                         (breakdown_table(kinds, 32768), ["attn_partial", "0.325", "13.5", "12,346", "28.8"])):
        console = Console(width=80, record=True)
        console.print(table)
        text = console.export_text()
        assert max(len(line) for line in text.splitlines()) <= 80
        for cell in cells:
            assert cell in text, (cell, text)
        assert "…" not in text
    # narrower, a cell folds onto a second line and keeps its digits
    console = Console(width=50, record=True)
    console.print(results_table(rows))
    assert "…" not in console.export_text()
