"""The device sampler (kernels/sample.cu) draws the host sampler's tokens (engine/sampling.py), bit for bit:
the kernel alone at real vocabulary sizes, and inside the captured step on tiny and random-weight models,
for every configuration; penalties, logprobs, graph against eager, NaN."""

import zlib

import numpy as np
import pytest

from engine.errors import NonFiniteLogits
from engine.sampling import Sampler, SamplingParams, sample, token_logprobs
from graphs.buffers import STATE_DTYPE, STATE_NONFINITE, repeat_window, state_record

pytestmark = pytest.mark.gpu
PROMPT = [5, 17, 99, 3, 250, 8, 42]
CONFIGS = {
    "defaults": SamplingParams(),
    "top-p": SamplingParams(temperature=1.0, top_k=0, top_p=0.9),
    "top-k": SamplingParams(temperature=1.1, top_k=40, top_p=1.0),
    "min-p": SamplingParams(temperature=0.9, top_k=0, top_p=1.0, min_p=0.05),
    "penalties": SamplingParams(repeat_penalty=1.3, repeat_last_n=16, presence_penalty=0.4, frequency_penalty=0.3),
    "all": SamplingParams(temperature=0.7, top_k=100, top_p=0.8, min_p=0.02, repeat_penalty=1.1, repeat_last_n=-1,
                          presence_penalty=-0.2, frequency_penalty=0.1, logprobs=5),
}


@pytest.fixture(scope="module")
def cp():
    import cupy

    from kernels.cuda import init

    init()
    return cupy


@pytest.fixture
def rng(request):
    seed = zlib.crc32(request.node.name.encode())
    print(f"rng seed {seed}")
    return np.random.default_rng(seed)


class Kernel:
    """One sampler launch over its own buffers, fed the host's state record (state_record)."""

    def __init__(self, cp, vocab: int, max_ctx: int = 64, ring: int = 8):
        from kernels import ops

        self.cp, self.vocab, self.ring_size = cp, vocab, ring
        self.logits = cp.empty(vocab, cp.float32)
        self.amax = cp.zeros(1, cp.uint64)
        self.state = cp.zeros(STATE_DTYPE.itemsize, cp.uint8)
        self.tokens = cp.zeros(max_ctx, cp.int32)
        self.ring = cp.full(ring, -7, cp.int32)
        self.lp_ring = cp.zeros((ring, ops.SAMPLE_LP_WORDS), cp.int32)
        self.counts = cp.zeros(vocab, cp.int32)
        self.window = cp.zeros(vocab, cp.int32)
        grid, _ = ops.sample_shape(vocab, ops.sm_count())
        self.work = cp.zeros(ops.sample_work_words(grid), cp.uint64)
        self.launch = ops.sample(self.logits, self.amax, self.state, self.tokens, self.ring, self.lp_ring,
                                 self.counts, self.window, self.work, vocab=vocab, max_ctx=max_ctx)

    def draw(self, x, params, seed=0, step=0, pos=0, prompt_len=1, counts=None, window=None) -> dict:
        x = np.asarray(x, np.float32)
        self.logits.set(x)
        self.amax.set(amax_of(x))
        st = state_record(params, seed, token=0, pos=pos, prompt_len=prompt_len, ring_mask=self.ring_size - 1)
        st["step"] = step
        self.state.set(st.view(np.uint8))
        self.counts.set(np.zeros(self.vocab, np.int32) if counts is None else np.asarray(counts, np.int32))
        w = np.zeros(self.vocab, np.int32)
        if window is not None:
            np.add.at(w, np.asarray(window, np.int64), 1)
        self.window.set(w)
        self.launch(None)
        self.cp.cuda.get_current_stream().synchronize()
        assert self.amax.get()[0] == 0, "the sampler resets the argmax word"
        from kernels.ops import SAMPLE_MAX_RECORDS

        work = self.work.get()
        assert not work[2:5].any() and not work[8 : 8 + 2 * (SAMPLE_MAX_RECORDS + 1)].any(), "accumulators left zero"
        out = self.state.get().view(STATE_DTYPE)[0]
        slot = pos % self.ring_size
        return {"state": out, "ring": self.ring.get()[slot], "lp": self.lp_ring.get()[slot],
                "counts": self.counts.get(), "window": self.window.get()}


def amax_of(x):
    """The packed argmax word the lm_head GEMV leaves for the sampler (value key, then lowest index)."""
    u = (np.asarray(x, np.float32) + np.float32(0)).view(np.uint32).astype(np.uint64)
    key = np.where(u & 0x80000000, ~u & 0xFFFFFFFF, u | 0x80000000)
    i = int(np.argmax(key))
    return np.array([(int(key[i]) << 32) | (0xFFFFFFFF - i)], np.uint64)


def lp_record(rec) -> tuple:
    f = rec.view(np.float32)
    n = int(rec[2])
    return int(rec[0]), float(f[1]), [(int(rec[3 + 2 * j]), float(f[4 + 2 * j])) for j in range(n)]


VOCABS = [320, 49152, 128256, 151936]


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("name", CONFIGS)
def test_kernel_draws_the_host_token(cp, rng, vocab, name):
    params = CONFIGS[name]
    k = Kernel(cp, vocab)
    for trial in range(10):
        spread = (0.3, 1.0, 4.0, 10.0)[trial % 4]  # flat (every token a candidate) to peaked
        x = (rng.standard_normal(vocab) * spread).astype(np.float32)
        if trial % 3 == 0:
            x[rng.integers(0, vocab, 6)] = x.max()  # ties at the top
        counts = np.zeros(vocab, np.int32)
        counts[rng.integers(0, vocab, 30)] = rng.integers(1, 4, 30)
        counts[int(np.argmax(x))] = 2
        window = rng.integers(0, vocab, 20).tolist() + [int(np.argmax(x))]
        seed, step = int(rng.integers(0, 2**63)), int(rng.integers(0, 1000))
        got = k.draw(x, params, seed, step, counts=counts, window=window)
        want = sample(x, params, step, seed, window=window, counts=counts)
        assert int(got["ring"]) == int(got["state"]["token"]) == want, f"trial {trial}"
        assert got["state"]["step"] == step + 1 and got["state"]["pos"] == 1
        if params.logprobs is not None:
            tok, lp, top = lp_record(got["lp"])
            ref = token_logprobs(x, want, params.logprobs)
            assert tok == want and abs(lp - ref.logprob) < 1e-3
            assert [i for i, _ in top] == [i for i, _ in ref.top]
            np.testing.assert_allclose([v for _, v in top], [v for _, v in ref.top], atol=1e-3)


@pytest.mark.parametrize("levels,top_k,top_p", [(3, 40, 0.9), (100, 40, 0.9), (100000, 4096, 0.95), (20, 1, 1.0),
                                                 (2, 0, 0.5)])
def test_kernel_ties_at_the_thresholds(cp, rng, levels, top_k, top_p):
    # integer logits: the top-k and top-p thresholds fall inside large tie groups
    vocab = 151936
    k = Kernel(cp, vocab)
    params = SamplingParams(temperature=1.3, top_k=top_k, top_p=top_p)
    for _ in range(6):
        x = (rng.integers(0, levels, vocab) * (8.0 / levels)).astype(np.float32)
        seed, step = int(rng.integers(0, 2**63)), int(rng.integers(0, 1000))
        assert int(k.draw(x, params, seed, step)["ring"]) == sample(x, params, step, seed)


@pytest.mark.parametrize("penalized", [False, True])
def test_kernel_greedy(cp, rng, penalized):
    vocab = 151936
    k = Kernel(cp, vocab)
    x = rng.standard_normal(vocab).astype(np.float32)
    x[[5000, 777, 150000]] = 9.0
    params = SamplingParams(temperature=1e-38, repeat_penalty=1.5 if penalized else 1.0)
    window = [777] if penalized else None
    got = k.draw(x, params, 1, 4, pos=10, prompt_len=3, window=window)
    want = 5000 if penalized else 777
    assert int(got["state"]["token"]) == want == sample(x, params, 4, 1, window=window)
    assert got["state"]["pos"] == 11 and got["state"]["step"] == 5 and int(got["ring"]) == want
    assert k.tokens.get()[11] == want, "the sampler appends to the context"
    assert k.draw(x, params, 1, 4, pos=63, prompt_len=3)["state"]["pos"] == 64, "pos saturates at max_ctx"


def test_kernel_feeds_the_prompt(cp, rng):
    vocab = 1000
    k = Kernel(cp, vocab)
    k.tokens[:5] = cp.asarray([11, 22, 33, 44, 55], cp.int32)
    params = SamplingParams(repeat_penalty=1.2, repeat_last_n=2, frequency_penalty=0.5)
    got = k.draw(rng.standard_normal(vocab), params, 3, 0, pos=2, prompt_len=5, window=[22, 33])
    assert got["state"]["token"] == 44 and got["state"]["pos"] == 3 and got["state"]["step"] == 0
    assert not got["counts"].any(), "prompt tokens are not counted for presence/frequency"
    w = got["window"]
    assert w[44] == 1 and w[22] == 0 and w[33] == 1, "44 enters the window, 22 leaves"


def test_kernel_updates_the_penalty_counts(cp, rng):
    vocab = 5000
    k = Kernel(cp, vocab, max_ctx=64)
    ids = rng.integers(0, vocab, 10).astype(np.int32)
    k.tokens[:10] = cp.asarray(ids)
    params = SamplingParams(temperature=0.9, repeat_penalty=1.3, repeat_last_n=4, presence_penalty=0.5)
    window = repeat_window(ids, 9, 4).tolist()
    got = k.draw(rng.standard_normal(vocab) * 2, params, 5, 0, pos=9, prompt_len=10, window=window)
    t = int(got["state"]["token"])
    assert got["counts"][t] == 1 and got["counts"].sum() == 1
    want = np.bincount(np.r_[ids[7:10], t], minlength=vocab)  # the token at position 6 left
    np.testing.assert_array_equal(got["window"], want)


@pytest.mark.parametrize("bad", [np.nan, -np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("params", [SamplingParams(temperature=0), SamplingParams(),
                                    SamplingParams(temperature=0, presence_penalty=0.1, logprobs=2)])
def test_kernel_flags_non_finite_logits(cp, rng, bad, params):
    vocab = 49152
    k = Kernel(cp, vocab)
    x = rng.standard_normal(vocab).astype(np.float32)
    x[12345] = bad
    got = k.draw(x, params, 1, 0)
    assert int(got["ring"]) == -1 and got["state"]["flags"] & STATE_NONFINITE
    ok = k.draw(rng.standard_normal(vocab), params, 1, 0)
    assert int(ok["ring"]) >= 0 and not ok["state"]["flags"] & STATE_NONFINITE, "the flag clears per request"


# inside the captured step

def _backend(cfg, w, **kw):
    from engine.backend_cuda import CudaBackend

    return CudaBackend(cfg, w, **kw)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from engine.config import ModelConfig
    from engine.weights import load_weights
    from tests.tiny import make_tiny_model

    d = make_tiny_model(tmp_path_factory.mktemp("sampler"), "qwen2", tied=False, heads=4, kv_heads=2)
    cfg = ModelConfig.from_dir(d)
    return cfg, load_weights(d, cfg)


def follow(be, prompt, params, steps=64):
    """Replay step by step; each step's device token against the host Sampler on the device's logits."""
    host = Sampler(params, params.seed, be.cfg.vocab_size, prompt)
    n = len(prompt)
    be.replay(n - 1 - be.start(prompt, params, params.seed, prefill=True))  # the prompt, when not prefilled
    got = []
    for j in range(n - 1, n - 1 + steps):
        be.replay()
        logits = be.step_logits()
        token = int(be.bufs.ring[j % be.bufs.ring_size])
        assert token == host(logits), f"step {j - n + 1}"
        if params.logprobs is not None:
            lp = be._logprobs(j % be.bufs.ring_size)
            assert lp.token == token and abs(lp.logprob - host.logprobs.logprob) < 1e-3
            assert [i for i, _ in lp.top] == [i for i, _ in host.logprobs.top]
            np.testing.assert_allclose([v for _, v in lp.top], [v for _, v in host.logprobs.top], atol=1e-3)
        got.append(token)
    return got


@pytest.mark.parametrize("name", CONFIGS)
def test_step_draws_the_host_tokens_tiny(tiny, name):
    from dataclasses import replace

    cfg, w = tiny
    be = _backend(cfg, w, max_context=128)
    params = replace(CONFIGS[name], seed=1234, logprobs=CONFIGS[name].logprobs or 3)
    got = follow(be, PROMPT, params)
    assert len(set(got)) > 3
    assert list(be.generate(PROMPT, params, 64)) == got


@pytest.mark.parametrize("name", ["defaults", "top-p", "penalties"])
def test_step_draws_the_host_tokens_at_151936(name):
    from dataclasses import replace

    from engine.shapes import shape

    cfg = shape("qwen2.5-0.5b")
    be = _backend(cfg, None, max_context=256)
    follow(be, [1, 2, 3, 4], replace(CONFIGS[name], seed=99, logprobs=20), steps=24)


def test_graph_equals_eager_with_penalties(tiny):
    cfg, w = tiny
    params = replace_seed(CONFIGS["all"], 77)
    runs = []
    for use_graph in (True, False):
        be = _backend(cfg, w, max_context=128, use_graph=use_graph)
        tokens = list(be.generate(PROMPT, params, 64))
        runs.append((tokens, be.step_logits().view(np.uint32), be.bufs.counts.get(), be.bufs.window.get()))
    for a, b in zip(*runs, strict=True):
        np.testing.assert_array_equal(a, b)


def replace_seed(p, seed):
    from dataclasses import replace

    return replace(p, seed=seed)


def test_nan_logits_raise_with_the_step(tiny):
    from engine.weights import ModelWeights

    cfg, w = tiny
    head = w.lm_head.copy()
    head[7] = np.nan
    with pytest.raises(NonFiniteLogits, match="step 0 on the cuda backend"):
        _backend(cfg, ModelWeights(w.embed, w.layers, w.final_norm, head), max_context=64)  # its warm-up at load
    be = _backend(cfg, w, max_context=64)
    lm_head = be.weights.lm_head
    assert lm_head is not be.weights.embed and str(lm_head.dtype) == "uint16", "bf16 bits of an untied head"
    with be.stream:
        row = lm_head[7].copy()
        lm_head[7] = 0x7FC0  # a NaN row, after the warm-up
    for params in (SamplingParams(temperature=0, seed=1), SamplingParams(seed=1)):
        with pytest.raises(NonFiniteLogits, match="step 0 on the cuda backend"):
            list(be.generate(PROMPT, params, 8))
        assert be.device_state()["flags"] & STATE_NONFINITE
    with be.stream:
        lm_head[7] = row
    assert len(list(be.generate(PROMPT, SamplingParams(seed=1), 8))) == 8, "the flag clears per request"
