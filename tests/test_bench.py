"""gdecode bench: argument errors on any machine, and a real run where a GPU is present."""

import json

import pytest

from engine.bench import TG_TOKENS, kernel_kinds, kind_bytes
from engine.shapes import SHAPES, decode_bytes, shape
from tests.test_cli import assert_one_line_error, gdecode


def test_llama3_8b_roofline_matches_peers():
    # PEERS: ~285 tok/s at 4,278 GB/s for the 8B shape at short context
    assert 4278e9 / decode_bytes(SHAPES["llama3-8b"], 1) == pytest.approx(285, abs=1)


def test_breakdown_bytes_cover_the_step():
    cfg = shape("qwen2.5-0.5b")
    per_kind = kind_bytes(cfg, 1, 32)
    weights = sum(per_kind[k] for k in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"))
    assert weights == pytest.approx(decode_bytes(cfg, 0), rel=1e-3)
    assert len(kernel_kinds(cfg, 2 + 7 * cfg.num_layers + 1)) == 2 + 7 * cfg.num_layers + 1
    with pytest.raises(RuntimeError):
        kernel_kinds(cfg, 5)


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
            want = decode_bytes(cfg, depth + TG_TOKENS // 2 + 1) / (x["ms_per_token"] * 1e-3) / 1e9
            assert x["mode"] == "graph" and x["gb_s"] == pytest.approx(want, rel=1e-9), name
            assert x["pct_copy"] == pytest.approx(100 * x["gb_s"] / copy, rel=1e-9), name
        else:
            assert x["mode"] in ("prefill", "replay") and x["gb_s"] is None and x["pct_copy"] is None, name
    # the breakdown: one eager step at the last depth, every launch of it counted once
    kinds = out["breakdown"]
    n_launches = sum(k["launches"] for k in kinds)
    counts = {k: kernel_kinds(cfg, n_launches).count(k) for k in set(kernel_kinds(cfg, n_launches))}
    assert {k["kernel"]: k["launches"] for k in kinds} == counts
    assert {"qkv_proj", "attn_partial", "lm_head", "sample"} <= set(counts)
    nbytes = kind_bytes(cfg, 600 + 1, rows["tg128"]["splits"])
    for k in kinds:
        assert k["ms"] > 0 and k["us_per_launch"] == pytest.approx(1e3 * k["ms"] / k["launches"], rel=1e-9)
        assert k["gb_s"] == pytest.approx(nbytes[k["kernel"]] / (k["ms"] * 1e-3) / 1e9, rel=1e-9)
    assert sum(k["share"] for k in kinds) == pytest.approx(100, rel=1e-9)
    assert [k["ms"] for k in kinds] == sorted((k["ms"] for k in kinds), reverse=True)
