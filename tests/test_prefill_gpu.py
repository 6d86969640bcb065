"""Batched prefill: KV cache and last-token logits against a bf16 emulation of the prefill, and
prefill + decode against feeding the prompt one token at a time through the captured decode step.

Tolerances: prefill rounds the GEMM inputs (normed activations, attention output, SiLU gate), the
scaled queries and the softmax weights to bf16 on top of the bf16 KV cache, which moves K/V by up
to 1e-2 and logits by up to 1.8e-2 from the float32 reference: too much room, since a 2% error in
the softmax scale or eps x 10 moves them by about as much. So the device is compared with
tests/bf16_prefill.py, which makes exactly those roundings, at tolerances that only leave room for
float32 summation order (tests/test_bf16_prefill.py checks them on the CPU). The same size of error
can swap two nearly tied greedy picks, so a token sequence may leave the step-by-step one only
where that run's own top two logits are within TIE of each other (in units of the logits' standard
deviation); the comparison ends there.
"""

import functools
import zlib

import ml_dtypes
import numpy as np
import pytest

from engine.errors import GDecodeError
from tests.bf16_prefill import FIRST_KV_TOL, KV_TOL, LOGIT_TOL, errors, prefill_bf16, within
from tests.test_decode_gpu import bf16_models, reference

pytestmark = pytest.mark.gpu
MODELS = {
    "llama3": ("llama", dict(heads=4, kv_heads=2, tied=False, llama3_scaling=True)),
    "mistral": ("mistral", dict(heads=8, kv_heads=2, tied=False)),
    "qwen2": ("qwen2", dict(heads=4, kv_heads=2, tied=True)),
    "qwen3": ("qwen3", dict(heads=6, kv_heads=2, tied=False, head_dim=32, hidden=96, intermediate=136)),
    # the head shapes of the benchmark models: head_dim 128 with groups of 4, head_dim 64 with groups of 7
    "llama-hd128": ("llama", dict(heads=8, kv_heads=2, tied=True, head_dim=128)),
    "qwen2-hd64": ("qwen2", dict(heads=14, kv_heads=2, tied=False, head_dim=64, hidden=128)),
}
LENGTHS = [1, 7, 511, 512, 513, 1500]
CTX = 1600
STEPS = 32
# prefill + decode against the step-by-step decode: prefill rounds more than the decode step (see above)
STEPWISE_KV_TOL, STEPWISE_LOGIT_TOL, TIE = 3e-2, 5e-2, 0.1
POISON = 0xFFFF  # bf16 NaN


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    tiny = bf16_models(tmp_path_factory, MODELS)

    @functools.cache
    def get(name):
        from engine.backend_cuda import CudaBackend
        from graphs.prefill import prefill_for

        cfg, w = tiny(name)
        be = CudaBackend(cfg, w, max_context=CTX)
        return cfg, w, be, prefill_for(be)

    return get


def fresh_ids(cfg, name, n, salt=0):
    rng = np.random.default_rng(zlib.crc32(f"{name}/{n}/{salt}".encode()))
    return [int(t) for t in rng.integers(0, cfg.vocab_size, n)]


def poison(be, pf):
    import cupy as cp

    with be.stream:
        be.bufs.k_cache[:] = POISON
        be.bufs.v_cache[:] = POISON
        for a in (pf.x, pf.qkv, pf.gu, pf.logits):
            a[:] = cp.nan
        for a in (pf.xn, pf.q, pf.attn, pf.act):
            a[:] = POISON
    be.stream.synchronize()


def cache(be):
    """(k, v) bit patterns [L, n_kv, CTX, hd] uint16."""
    cfg = be.cfg
    shape = (cfg.num_layers, cfg.num_kv_heads, CTX, cfg.head_dim)
    be.stream.synchronize()
    return be.bufs.k_cache.get().reshape(shape), be.bufs.v_cache.get().reshape(shape)


def f32(bits):
    return bits.view(ml_dtypes.bfloat16).astype(np.float32)


def rel(a, b):
    assert np.isfinite(a).all()
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def worst_layer(got, want):
    return max(rel(got[i], want[i]) for i in range(got.shape[0]))


def report(what, errs):
    print(f"{what}: first K/V {errs[0]:.2e} (tol {FIRST_KV_TOL}), later K/V {errs[1]:.2e} (tol {KV_TOL}), "
          f"logits {errs[2]:.2e} (tol {LOGIT_TOL})")


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("name", list(MODELS))
def test_prefill_matches_bf16_emulation(model, name, n):
    cfg, w, be, pf = model(name)
    ids = fresh_ids(cfg, name, n)
    poison(be, pf)
    got = pf.run(ids, logits=True).get(stream=be.stream)
    k, v = cache(be)
    errs = errors(f32(k[:, :, :n]), f32(v[:, :, :n]), got, prefill_bf16(cfg, w, ids))
    report(f"{name} n={n}", errs)
    assert within(errs)
    assert (k[:, :, n:] == POISON).all() and (v[:, :, n:] == POISON).all()
    assert be.bufs.guards_intact()


@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_prefill_in_pieces_continues_the_cache(model, name):
    cfg, w, be, pf = model(name)
    ids = fresh_ids(cfg, name, 1100, salt=1)
    poison(be, pf)
    pf.run(ids[:300])
    pf.run(ids[300:301], start=300)
    got = pf.run(ids[301:], start=301, logits=True).get(stream=be.stream)
    k, v = cache(be)
    n = len(ids)
    errs = errors(f32(k[:, :, :n]), f32(v[:, :, :n]), got, prefill_bf16(cfg, w, ids))
    report(f"{name} in pieces", errs)
    assert within(errs)
    assert (k[:, :, n:] == POISON).all()


def first_step_logits(cfg, w, ids):
    """Logits of a decode step for ids[-1] over the emulated prefill cache of ids[:-1]."""
    ref = reference(cfg, w, CTX, 32, bf16_kv=True)
    if len(ids) > 1:
        want = prefill_bf16(cfg, w, ids[:-1])
        ref.k[:, :, : len(ids) - 1] = want.k
        ref.v[:, :, : len(ids) - 1] = want.v
        ref.pos = len(ids) - 1
    return ref.decode(ids[-1])


def decode_steps(be, first_pos, steps):
    """Replay `steps` decode steps one at a time: (sampled tokens, logits of each step)."""
    toks, logits = [], []
    for j in range(steps):
        be.replay()
        logits.append(be.step_logits())
        toks.append(int(be.bufs.ring[(first_pos + j) % be.bufs.ring_size]))
    return toks, logits


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("name", list(MODELS))
def test_prefill_then_decode_matches_stepwise(model, name, n):
    from graphs.prefill import prefill_then_decode_ready

    cfg, w, be, pf = model(name)
    ids = fresh_ids(cfg, name, n, salt=2)

    poison(be, pf)
    be.start(ids)
    be.replay(n - 1)
    want_toks, want_logits = decode_steps(be, n - 1, STEPS)
    want_k, want_v = cache(be)

    poison(be, pf)
    prefill_then_decode_ready(be, ids)
    st = be.device_state()
    assert st["pos"] == n - 1 and st["token"] == ids[-1] and st["prompt_len"] == n and st["step"] == 0
    toks, logits = decode_steps(be, n - 1, STEPS)
    k, v = cache(be)

    same = next((j for j in range(STEPS) if toks[j] != want_toks[j]), STEPS)
    if same < STEPS:
        lw = want_logits[same]
        gap = abs(lw[want_toks[same]] - lw[toks[same]]) / lw.std()
        print(f"{name} n={n}: tokens part at step {same}, a near tie ({gap:.3f} std)")
        assert gap < TIE
    worst = max(rel(logits[j], want_logits[j]) for j in range(min(same + 1, STEPS)))
    end = n + min(same, STEPS - 1)  # positions written from identical tokens
    ek = worst_layer(f32(k[:, :, :end]), f32(want_k[:, :, :end]))
    ev = worst_layer(f32(v[:, :, :end]), f32(want_v[:, :, :end]))
    print(f"{name} n={n}: {same} equal tokens, logits {worst:.2e}, K {ek:.2e} V {ev:.2e}")
    assert worst < STEPWISE_LOGIT_TOL and ek < STEPWISE_KV_TOL and ev < STEPWISE_KV_TOL
    first = rel(logits[0], first_step_logits(cfg, w, ids))
    print(f"{name} n={n}: first step after prefill {first:.2e} (tol {LOGIT_TOL})")
    assert first < LOGIT_TOL
    assert be.bufs.guards_intact()


def test_prompt_past_the_context_is_refused_before_device_work(model):
    from graphs.prefill import prefill_then_decode_ready

    cfg, w, be, pf = model("qwen2")
    poison(be, pf)
    before = be.bufs.prompt.get()
    with pytest.raises(GDecodeError, match="not fit the context"):
        pf.run(fresh_ids(cfg, "qwen2", CTX + 1))
    with pytest.raises(GDecodeError, match="not fit the context"):
        pf.run(fresh_ids(cfg, "qwen2", 10), start=CTX - 9)
    with pytest.raises(GDecodeError):
        prefill_then_decode_ready(be, fresh_ids(cfg, "qwen2", CTX + 1))
    with pytest.raises(GDecodeError, match="out of range"):
        pf.run([1, 2, cfg.vocab_size])
    k, v = cache(be)
    assert (k == POISON).all() and (v == POISON).all()
    assert np.array_equal(be.bufs.prompt.get(), before)
