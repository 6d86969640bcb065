"""Sampling parameters, the counter-based RNG and the host-side sampler."""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import numpy as np

from engine.errors import GDecodeError

SEED_MUL = 0x9E3779B97F4A7C15
STEP_MUL = 0xD1B54A32D192ED03
U_MAX = np.float32(1.0 - 2.0**-24)
MAX_LOGPROBS = 20


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token.

    temperature 0 means greedy; top_k 0, top_p 1.0 and min_p 0.0 switch those filters off.
    seed None lets the caller pick a random seed (see `resolve_seed`).
    repeat_penalty (llama.cpp): over the last repeat_last_n tokens of the context (-1: all of
    it, 0: none), a logit l becomes l / penalty if l > 0 else l * penalty; 1.0 is off.
    presence_penalty and frequency_penalty (OpenAI API): l -= presence * (c > 0) + frequency * c,
    where c counts the token among the generated tokens (not the prompt).
    logprobs: None is off; n in [0, 20] returns the chosen token's log-probability and the top n.
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
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise GDecodeError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise GDecodeError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise GDecodeError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**64):
            raise GDecodeError(f"seed must be an integer in [0, 2^64), got {self.seed}")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise GDecodeError(f"max_new_tokens must be an integer, got {self.max_new_tokens}")
        if self.max_new_tokens < 1:
            raise GDecodeError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        stop = tuple(self.stop) if isinstance(self.stop, (list, tuple)) else None
        if stop is None or not all(isinstance(s, str) and s for s in stop):
            raise GDecodeError(f"stop must be a sequence of non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)
        if not (_is_number(self.min_p) and 0.0 <= self.min_p <= 1.0):
            raise GDecodeError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        if not (_is_number(self.repeat_penalty) and math.isfinite(self.repeat_penalty) and self.repeat_penalty > 0):
            raise GDecodeError(f"repeat_penalty must be a finite number > 0 (1 = off), got {self.repeat_penalty}")
        if not _is_int(self.repeat_last_n) or self.repeat_last_n < -1:
            raise GDecodeError(f"repeat_last_n must be an integer >= 0, or -1 for the whole context, "
                               f"got {self.repeat_last_n}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (_is_number(v) and math.isfinite(v)):
                raise GDecodeError(f"{name} must be a finite number (0 = off), got {v}")
        if self.logprobs is not None and not (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise GDecodeError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


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
    with np.errstate(over="ignore"):
        s = np.array([seed], np.uint64) * np.uint64(SEED_MUL)
        t = np.array([step], np.uint64) * np.uint64(STEP_MUL)
        x = (s + t)[0] + i
        x = x ^ (x >> np.uint64(30))
        x = x * np.uint64(0xBF58476D1CE4E5B9)
        x = x ^ (x >> np.uint64(27))
        x = x * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return x


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


def candidates(z: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """Indices kept by top-k then top-p, in ascending index order."""
    n = z.shape[0]
    if 0 < top_k < n:
        kth = np.partition(z, n - top_k)[n - top_k]
        kept = np.flatnonzero(z >= kth)
    else:
        kept = np.arange(n)
    if top_p >= 1.0 or kept.size == 1:
        return kept
    # descending value, ties by lower index first
    order = kept[np.lexsort((kept, -z[kept]))]
    zs = z[order]
    p = np.exp(zs - zs[0])
    p /= p.sum(dtype=np.float32)
    cum = np.cumsum(p, dtype=np.float32)
    n_keep = min(int(np.searchsorted(cum, np.float32(top_p), side="left")) + 1, order.size)
    return np.sort(order[:n_keep])


def sample(logits: np.ndarray, params: SamplingParams, step: int, seed: int) -> int:
    """Pick the next token id from logits [V].

    Greedy: argmax, lowest index on ties. Otherwise z = logits / T (float32), keep the top-k
    (every value >= the k-th largest), then the smallest prefix of the kept set sorted by
    descending z whose softmax mass reaches top_p (at least one token), then Gumbel-max:
    argmax over kept i of z_i - log(-log(u_i)) with u_i = rng_uniform(seed, step, i),
    the lowest index on ties. The same (logits, params, step, seed) always gives the same token.
    """
    logits = np.asarray(logits, dtype=np.float32)
    if params.greedy:
        return int(np.argmax(logits))
    z = logits / np.float32(params.temperature)
    kept = candidates(z, params.top_k, params.top_p)
    u = rng_uniform(seed, step, kept)
    score = z[kept] - np.log(-np.log(u))
    return int(kept[np.argmax(score)])
