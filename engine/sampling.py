"""Sampling parameters, the counter-based RNG and the host sampler that the device sampler matches.

The sampler (both backends, token for token):
  1. penalties on the logits l (see SamplingParams), in float32;
  2. greedy (temperature below GREEDY_BELOW): the largest l, lowest index on ties;
  3. z = l / T (float32). A token is kept when #{z_j > z_i} < top_k, mass{z_j > z_i} < top_p * total
     mass, and z_i - max z >= log(min_p): membership depends on z_i alone, and a kept token keeps every
     larger one. The mass of a token is q_i = floor(exp_f32(z_i - max z) * 2^40), an integer, so sums are
     exact in any order;
  4. Gumbel-max over the kept tokens: the largest s_i = z_i - log(-log(u_i)), u_i = rng_uniform(seed,
     step, i), lowest index on ties. Without sorting: the "records" are the winner over all tokens, then
     the winner over the tokens with a larger z than that one, and so on; the first record that is kept
     is the answer (rejection over pivots, as FlashInfer samples top-k/top-p).
exp_f32 and log_f32 use only correctly rounded float32 operations in a fixed order, so the device
computes the same bits, and every decision compares integers or identically computed floats: no
summation order can flip a token. What remains: the device keeps at most 64 records per block and
overall (a slice of n tokens has about ln n + 0.6, so more than 64 has a chance below 1e-20) and
takes the largest z if they ran out; log-probabilities are computed in double from the same integer
sums, equal to within rounding (1e-6).
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import numpy as np

from engine.errors import BadSampling, GDecodeError, NonFiniteLogits

SEED_MUL = 0x9E3779B97F4A7C15
STEP_MUL = 0xD1B54A32D192ED03
U_MAX = np.float32(1.0 - 2.0**-24)
MAX_LOGPROBS = 20
GREEDY_BELOW = 1e-5  # temperatures below this sample greedily (1/T would overflow the logits)
CUT = np.float32(24.0)  # the Gumbel noise spans less than 20: a token this far below the best never wins
MASS_BITS = 40
MASS_FLOOR = np.float32(-28.0)  # exp(-28) * 2^40 < 1: a token this far below the best has mass 0
F32_MAX, F32_TINY = float(np.finfo(np.float32).max), float(np.finfo(np.float32).tiny)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_f32(v) -> bool:
    """A number the samplers can hold: both apply it in float32, where 1e39 is already Inf."""
    return _is_number(v) and math.isfinite(v) and abs(v) <= F32_MAX


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token.

    temperature 0 means greedy; top_k 0, top_p 1.0 and min_p 0.0 switch those filters off.
    seed None lets the caller pick a random seed (see `resolve_seed`).
    repeat_penalty (llama.cpp): over the last repeat_last_n tokens of the context (-1: all of
    it, 0: none), a logit l becomes l / penalty if l > 0 else l * penalty; 1.0 is off.
    presence_penalty and frequency_penalty (OpenAI API): l -= presence * (c > 0) + frequency * c,
    where c counts the token among the generated tokens (not the prompt).
    logprobs: None is off; n in [0, 20] returns the chosen token's log-probability and the top n,
    under the model's own distribution (the softmax of the logits before penalties and temperature).
    Filters and penalties act on the tempered, penalized logits; temperature < 1e-5 is greedy.
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    seed: int | None = None
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and 0 <= self.temperature <= F32_MAX):
            raise BadSampling("temperature", f"must be a finite float32 number >= 0, got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise BadSampling("top_k", f"must be an integer >= 0 (0 = off), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise BadSampling("top_p", f"must be in (0, 1] (1 = off), got {self.top_p}")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**64):
            raise BadSampling("seed", f"must be an integer in [0, 2^64), got {self.seed}")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise BadSampling("max_new_tokens", f"must be an integer, got {self.max_new_tokens}")
        if self.max_new_tokens < 1:
            raise BadSampling("max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        stop = tuple(self.stop) if isinstance(self.stop, (list, tuple)) else None
        if stop is None or not all(isinstance(s, str) and s for s in stop):
            raise BadSampling("stop", f"must be a sequence of non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)
        if not (_is_number(self.min_p) and 0.0 <= self.min_p <= 1.0):
            raise BadSampling("min_p", f"must be in [0, 1] (0 = off), got {self.min_p}")
        if not (_is_f32(self.repeat_penalty) and self.repeat_penalty >= F32_TINY):
            raise BadSampling("repeat_penalty", f"must be a finite float32 number > 0, at least {F32_TINY:.3g} "
                                                f"(1 = off), got {self.repeat_penalty}")
        if not _is_int(self.repeat_last_n) or self.repeat_last_n < -1:
            raise BadSampling("repeat_last_n", f"must be an integer >= 0, or -1 for the whole context, "
                                               f"got {self.repeat_last_n}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_f32(v):
                raise BadSampling(name, f"must be a finite float32 number (0 = off), got {v}")
        if self.logprobs is not None and not (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise BadSampling("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalizes_repeats(self) -> bool:
        return self.repeat_penalty != 1.0 and self.repeat_last_n != 0

    @property
    def penalizes_counts(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def min_p_log(self) -> np.float32:
        """log(min_p) in float32, the threshold on z - max z; -inf when min_p is off."""
        return np.float32(math.log(self.min_p)) if self.min_p > 0 else np.float32(-np.inf)


def resolve_seed(params: SamplingParams) -> int:
    """The seed to sample with: params.seed, or a fresh random 63-bit one when it is None."""
    return params.seed if params.seed is not None else secrets.randbits(63)


def rng_bits(seed: int, step: int, idx) -> np.ndarray:
    """Counter-based 64-bit random words, one per index (uint64 arithmetic, wrapping mod 2^64).

    x = seed * 0x9E3779B97F4A7C15 + step * 0xD1B54A32D192ED03 + i
    x ^= x >> 30; x *= 0xBF58476D1CE4E5B9
    x ^= x >> 27; x *= 0x94D049BB133111EB
    x ^= x >> 31                                  (the splitmix64 finalizer)
    """
    if not (0 <= seed < 2**64 and 0 <= step < 2**64):
        raise GDecodeError(f"seed and step must be in [0, 2^64), got {seed}, {step}")
    i = np.asarray(idx, dtype=np.uint64)
    # uint64 array arithmetic wraps silently
    s = np.array([seed], np.uint64) * np.uint64(SEED_MUL)
    t = np.array([step], np.uint64) * np.uint64(STEP_MUL)
    x = (s + t)[0] + i
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def rng_uniform(seed: int, step: int, idx) -> np.ndarray:
    """Uniform float32 in (0, 1) for each index, reproducible bit-exactly on the GPU.

    u = min(((x >> 40) + 0.5) * 2^-24, 1 - 2^-24), where x = rng_bits(seed, step, i),
    in float32 with round-to-nearest-even: (x >> 40) is exact, + 0.5f rounds, * 2^-24 is exact.
    In CUDA: fminf(__fadd_rn((float)(x >> 40), 0.5f) * 0x1p-24f, 0x1.fffffep-1f).
    The clamp matters only for x >> 40 == 2^24 - 1, whose sum rounds up to 2^24.
    """
    return uniform_from_bits(rng_bits(seed, step, idx))


def uniform_from_bits(x: np.ndarray) -> np.ndarray:
    top = (np.asarray(x, dtype=np.uint64) >> np.uint64(40)).astype(np.float32)
    return np.minimum((top + np.float32(0.5)) * np.float32(2.0**-24), U_MAX)




# float32 exp and log from correctly rounded operations only (no fused multiply-add), in the order
# kernels/sample.cu repeats them; the polynomials are Cephes' expf and logf
LOG2E_F = np.float32(1.44269504088896341)
LN2_HI = np.float32(0.693359375)
LN2_LO = np.float32(-2.12194440e-4)
EXP_POLY = tuple(np.float32(c) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
                                         1.6666665459e-1, 5.0000001201e-1))
LOG_POLY = tuple(np.float32(c) for c in (7.0376836292e-2, -1.1514610310e-1, 1.1676998740e-1, -1.2420140846e-1,
                                         1.4249322787e-1, -1.6668057665e-1, 2.0000714765e-1, -2.4999993993e-1,
                                         3.3333331174e-1))
SQRT2_F = np.float32(1.41421356)


def exp_f32(x) -> np.ndarray:
    """exp(x) for float32 x in [MASS_FLOOR, 0], bit-identical to kernels/sample.cu's exp_f32."""
    x = np.asarray(x, np.float32)
    k = np.rint(x * LOG2E_F)
    r = x - k * LN2_HI
    r = r - k * LN2_LO
    p = EXP_POLY[0]
    for c in EXP_POLY[1:]:
        p = p * r + c
    y = p * (r * r)
    y = y + r
    y = y + np.float32(1.0)
    scale = ((k.astype(np.int32) + 127) << 23).astype(np.uint32).view(np.float32)
    return (y * scale).astype(np.float32)


def log_f32(x) -> np.ndarray:
    """log(x) for normal float32 x > 0, bit-identical to kernels/sample.cu's log_f32."""
    x = np.asarray(x, np.float32)
    bits = x.view(np.uint32)
    e = (bits >> np.uint32(23)).view(np.int32) - 127
    f = ((bits & np.uint32(0x7FFFFF)) | np.uint32(0x3F800000)).view(np.float32)
    big = f > SQRT2_F
    f = np.where(big, f * np.float32(0.5), f)
    ef = (e + big).astype(np.float32)
    t = f - np.float32(1.0)
    z = t * t
    p = LOG_POLY[0]
    for c in LOG_POLY[1:]:
        p = p * t + c
    y = t * (z * p)
    y = y + ef * LN2_LO
    y = y - np.float32(0.5) * z
    r = t + y
    return (r + ef * LN2_HI).astype(np.float32)


def mass_q(x) -> np.ndarray:
    """Integer token masses floor(exp_f32(x) * 2^40) (uint64) of x = z - max z; 0 below MASS_FLOOR (where
    the floor of exp(x) * 2^40 is 0 already, so exp_f32 is evaluated at the floor instead)."""
    return (exp_f32(np.maximum(x, MASS_FLOOR)) * np.float32(2.0**MASS_BITS)).astype(np.uint64)


def float_keys(x) -> np.ndarray:
    """Order-preserving uint32 keys of float32 values (-0 and +0 share one), as key_of in the kernels."""
    u = (np.asarray(x, np.float32) + np.float32(0)).view(np.uint32)
    return np.where(u >> np.uint32(31) != 0, ~u, u | np.uint32(0x80000000))


def gumbel_scores(z: np.ndarray, idx: np.ndarray, seed: int, step: int) -> np.ndarray:
    """s = z - log(-log(u)) with u = rng_uniform(seed, step, idx), in float32."""
    return z - log_f32(-log_f32(rng_uniform(seed, step, idx)))


def score_keys(s: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """uint64 record keys: the larger score s wins, then the lower index (argmax_key in the kernels)."""
    return (float_keys(s).astype(np.uint64) << np.uint64(32)) | (np.uint64(0xFFFFFFFF) - idx.astype(np.uint64))


def records(zk: np.ndarray, rk: np.ndarray) -> np.ndarray:
    """Positions of the successive round winners: the largest rk, then the largest rk among strictly
    larger zk, and so on until nothing is larger (so zk ascends and rk descends)."""
    order = np.lexsort((rk, zk))[::-1]  # zk descending, then rk descending
    rs = rk[order]
    # a record beats every rk ahead of it: those of larger zk, and (a tie group's first beats the
    # rest of its group) those of equal zk
    win = np.ones(order.size, bool)
    win[1:] = rs[1:] > np.maximum.accumulate(rs)[:-1]
    return order[win][::-1]


def penalize(logits: np.ndarray, params: SamplingParams, window=None, counts=None) -> np.ndarray:
    """The logits after the repeat penalty (tokens in `window`) and the presence/frequency penalties
    (counts[i]: how often token i was generated), in float32."""
    lg = np.array(logits, dtype=np.float32)
    # a logit that overflows becomes Inf without a warning: sample() reports it (NonFiniteLogits)
    with np.errstate(over="ignore", invalid="ignore"):
        if params.penalizes_repeats and window is not None and len(window):
            w = np.unique(window)
            v, rp = lg[w], np.float32(params.repeat_penalty)
            lg[w] = np.where(v > 0, v / rp, v * rp)
        if params.penalizes_counts and counts is not None:
            seen = np.flatnonzero(counts)
            c = np.asarray(counts)[seen].astype(np.float32)
            lg[seen] = lg[seen] - (np.float32(params.presence_penalty) + np.float32(params.frequency_penalty) * c)
    return lg


def sample(logits: np.ndarray, params: SamplingParams, step: int, seed: int, *, window=None,
           counts=None) -> int:
    """The next token id from logits [V] (see the module docstring for the exact rule).

    window: the token ids the repeat penalty covers; counts [V]: generated-token counts for the
    presence/frequency penalties. Raises NonFiniteLogits when the (penalized, tempered) logits are
    not all finite. The same arguments always give the same token.
    """
    lg = penalize(logits, params, window, counts)
    z = lg if params.greedy else lg / np.float32(params.temperature)
    bad = np.count_nonzero(~np.isfinite(z))
    if bad:
        raise NonFiniteLogits(step, "numpy", bad, params)
    if params.greedy:
        return int(np.argmax(z))
    m = z.max()
    cand = np.flatnonzero(z >= m - CUT)
    zk = float_keys(z)
    recs = cand[records(zk[cand], score_keys(gumbel_scores(z[cand], cand, seed, step), cand))]
    q = mass_q(z - m)
    total = float(q.sum())
    top_p, min_p_log = np.float32(params.top_p), params.min_p_log
    for i in recs[:-1]:  # the last record holds the largest z, which every filter keeps
        above = zk > zk[i]
        if 0 < params.top_k <= np.count_nonzero(above):
            continue
        if top_p < 1 and not float(q[above].sum()) < float(top_p) * total:
            continue
        if not z[i] - m >= min_p_log:
            continue
        return int(i)
    return int(recs[-1])


@dataclass(frozen=True)
class TokenLogprobs:
    """A generated token's log-probability and the n most likely tokens' (id, logprob), best first,
    under the softmax of the raw logits."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def token_logprobs(logits: np.ndarray, token: int, n: int) -> TokenLogprobs:
    """log-softmax of the raw logits at `token` and at the n largest (lowest index first on ties); the
    normalizer sums the integer masses of mass_q, as the device does."""
    lg = np.asarray(logits, np.float32)
    m = lg.max()
    total = float(mass_q(lg - m).sum())
    lse = float(m) + math.log(total * 2.0**-MASS_BITS)
    best = np.argsort(-lg, kind="stable")[:n]
    return TokenLogprobs(int(token), float(lg[token]) - lse, tuple((int(i), float(lg[i]) - lse) for i in best))


class Sampler:
    """One request's sampling on the host: the step counter, the context for the repeat penalty and the
    counts of generated tokens for the presence/frequency penalties."""

    def __init__(self, params: SamplingParams, seed: int, vocab: int, context):
        self.params, self.seed = params, seed
        self.context = [int(t) for t in context]
        self.counts = np.zeros(vocab, np.int32)
        self.step = 0
        self.logprobs: TokenLogprobs | None = None

    def window(self) -> list[int]:
        """The last repeat_last_n tokens of the context (all of it for -1)."""
        n = self.params.repeat_last_n
        return self.context if n < 0 else self.context[max(0, len(self.context) - n):]

    def __call__(self, logits: np.ndarray) -> int:
        """The next token after `logits`; it joins the context and the counts."""
        p = self.params
        token = sample(logits, p, self.step, self.seed, window=self.window(), counts=self.counts)
        if p.logprobs is not None:
            self.logprobs = token_logprobs(logits, token, p.logprobs)
        self.context.append(token)
        self.counts[token] += 1
        self.step += 1
        return token
