"""gdecode bench: argument errors on any machine, and a real run where a GPU is present."""

import json

import pytest

from engine.bench import kind_bytes
from engine.shapes import SHAPES, decode_bytes, shape
from tests.test_cli import assert_one_line_error, gdecode


def test_llama3_8b_roofline_matches_peers():
    # PEERS: ~285 tok/s at 4,278 GB/s for the 8B shape at short context
    assert 4278e9 / decode_bytes(SHAPES["llama3-8b"], 1) == pytest.approx(285, abs=1)


def test_breakdown_bytes_cover_the_step():
    from graphs.decode import STEP_KINDS

    cfg = shape("qwen2.5-0.5b")
    per_kind = kind_bytes(cfg, 1, 32, 64)
    assert set(per_kind) == set(STEP_KINDS), "every launch kind of the step has a byte count"
    weights = sum(per_kind[k] for k in ("qkv_proj", "o_proj", "gate_up", "down_proj", "lm_head"))
    assert weights == pytest.approx(decode_bytes(cfg, 0), rel=1e-3)
    # attention reads the K/V rows, plus the partials of the active splits once there is more than one
    kv_row = 2 * 2 * cfg.kv_size * cfg.num_layers
    one_split = kind_bytes(cfg, 64, 32, 64)["attn"]
    assert one_split - per_kind["attn"] == 63 * kv_row
    partials = 2 * cfg.num_heads * 2 * (cfg.head_dim + 2) * 4 * cfg.num_layers
    assert kind_bytes(cfg, 65, 32, 64)["attn"] - one_split == kv_row + partials


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
def test_bench_json_smoke():
    r = gdecode("bench", "--shape", "smollm2-135m", "--depth", "0,600", "--json", "--breakdown")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["copy_gb_s"] > 100
    tests = {x["test"] for x in out["results"]}
    assert tests == {"pp512", "tg128", "pp512@600", "tg128@600"}
    for x in out["results"]:
        assert x["tok_s"] > 0 and x["ms_per_token"] > 0
    assert {k["kernel"] for k in out["breakdown"]} == {"embed", "qkv_proj", "attn", "o_proj", "gate_up", "down_proj",
                                                       "lm_head", "sample"}
