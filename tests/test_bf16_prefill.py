"""The bf16 prefill emulation that the GPU prefill tests compare against: it rounds what the device
rounds, its tolerances hold against another float32 summation order, and the bugs the GPU tests are
meant to catch move it beyond them."""

import dataclasses

import numpy as np
import pytest

from engine.reference import ReferenceModel
from tests.bf16_prefill import FIRST_KV_TOL, KV_TOL, LOGIT_TOL, bf16, errors, prefill_bf16, within
from tests.test_decode_gpu import bf16_models
from tests.test_prefill_gpu import MODELS, fresh_ids

CASES = [("llama3", 7), ("llama3", 513), ("qwen2-hd64", 513)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return bf16_models(tmp_path_factory, MODELS)


def show(what, errs):
    print(f"{what}: first K/V {errs[0]:.1e}, later K/V {errs[1]:.1e}, logits {errs[2]:.1e}")


@pytest.mark.parametrize("name,n", CASES)
def test_cache_holds_bf16_values_and_stays_near_float32(model, name, n):
    cfg, w = model(name)
    ids = fresh_ids(cfg, name, n)
    want = prefill_bf16(cfg, w, ids)
    assert want.k.shape == (cfg.num_layers, cfg.num_kv_heads, n, cfg.head_dim) == want.v.shape
    assert np.array_equal(want.k, bf16(want.k)) and np.array_equal(want.v, bf16(want.v))
    ref = ReferenceModel(cfg, w, n)
    logits = ref.prefill(ids)
    errs = errors(ref.k, ref.v, logits, want)
    show("float32 reference", errs)
    # the roundings are real (the float32 model is outside the tolerances) and small
    assert errs[0] > 2 * FIRST_KV_TOL and errs[1] > KV_TOL / 2
    assert max(errs) < 2e-2


@pytest.mark.parametrize("name,n", CASES)
def test_another_summation_order_stays_inside(model, name, n):
    cfg, w = model(name)
    ids = fresh_ids(cfg, name, n)
    want = prefill_bf16(cfg, w, ids)
    wide = prefill_bf16(cfg, w, ids, wide=True)
    errs = errors(wide.k, wide.v, wide.logits, want)
    show("float64 sums", errs)
    assert within(errs)
    assert errs[0] < FIRST_KV_TOL / 4


@pytest.mark.parametrize("name,n", CASES)
def test_softmax_scale_and_eps_errors_move_outside(model, name, n):
    cfg, w = model(name)
    ids = fresh_ids(cfg, name, n)
    want = prefill_bf16(cfg, w, ids)
    scaled = prefill_bf16(cfg, w, ids, scale=1.02 * cfg.head_dim**-0.5)
    errs = errors(scaled.k, scaled.v, scaled.logits, want)
    show("softmax scale x 1.02", errs)
    assert errs[1] > 1.5 * KV_TOL  # the first attention feeds the second layer's K/V
    eps = prefill_bf16(dataclasses.replace(cfg, rms_norm_eps=cfg.rms_norm_eps * 10), w, ids)
    errs = errors(eps.k, eps.v, eps.logits, want)
    show("eps x 10", errs)
    assert errs[0] > 4 * FIRST_KV_TOL and errs[1] > KV_TOL


def test_logits_follow_the_last_token(model):
    cfg, w = model("qwen2-hd64")
    ids = fresh_ids(cfg, "qwen2-hd64", 9)
    want = prefill_bf16(cfg, w, ids)
    other = prefill_bf16(cfg, w, ids[:-1] + [(ids[-1] + 1) % cfg.vocab_size])
    assert np.array_equal(want.k[:, :, :-1], other.k[:, :, :-1])
    assert errors(other.k, other.v, other.logits, want)[2] > 10 * LOGIT_TOL
