import numpy as np


class GDecodeError(Exception):
    """A user-facing error: the CLI prints its message on one line and exits non-zero."""


class BadSampling(GDecodeError):
    """A sampling parameter out of its range: `field` (a SamplingParams field) and what is wrong with it,
    so that each front end can name the parameter as its users spell it (renamed)."""

    def __init__(self, field: str, problem: str):
        self.field, self.problem = field, problem
        super().__init__(f"{field} {problem}")

    def renamed(self, name: str) -> GDecodeError:
        return GDecodeError(f"{name} {self.problem}")


class NonFiniteLogits(GDecodeError):
    """The logits of a step hold NaN or Inf: the weights or the arithmetic went wrong, so no token is sampled."""

    def __init__(self, step: int, backend: str, count: int | None = None, params=None):
        self.step, self.backend = step, backend
        what = f"{count} non-finite value{'' if count == 1 else 's'} (NaN or Inf)" if count else \
            "non-finite values (NaN or Inf)"
        why = "the weights hold NaN/Inf or the activations overflowed"
        on = [] if params is None else [f"{name} {getattr(params, name):g}" for name, used in (
            ("repeat_penalty", params.penalizes_repeats), ("presence_penalty", params.presence_penalty != 0),
            ("frequency_penalty", params.frequency_penalty != 0)) if used]
        if on:
            why = (f"the weights hold NaN/Inf, the activations overflowed, or the penalties ({', '.join(on)}) took "
                   "a logit past the float32 range")
        super().__init__(f"the logits of generation step {step} on the {backend} backend hold {what}: {why}")


def not_a_file(path, kind: str) -> GDecodeError:
    """The error for a path that exists but is not the regular file a `kind` file must be."""
    return GDecodeError(f"{path}: " + (f"a directory, not a {kind} file" if path.is_dir() else "not a regular file"))


def check_tokens(ids, vocab_size: int, max_context: int, start: int = 0) -> None:
    """Raise GDecodeError unless every id is in [0, vocab_size) and positions start..start+len(ids)-1
    fit a context of max_context positions (the one range check of every path into a KV cache)."""
    ids = np.asarray(ids)
    n = ids.size
    if start < 0 or start + n > max_context:
        s = "s" if n != 1 else ""
        raise GDecodeError(f"{n} token{s} at position {start} do{'es' * (n == 1)} not fit the context of "
                           f"{max_context} positions")
    if n and (ids.min() < 0 or ids.max() >= vocab_size):
        raise GDecodeError(f"token id out of range [0, {vocab_size})")
