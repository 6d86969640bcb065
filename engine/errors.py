import numpy as np


class GDecodeError(Exception):
    """A user-facing error: the CLI prints its message on one line and exits non-zero."""


class NonFiniteLogits(GDecodeError):
    """The logits of a decode step hold NaN or Inf (after penalties and temperature)."""

    def __init__(self, step: int, backend: str):
        super().__init__(f"the logits of generated token {step} hold NaN or Inf ({backend} backend): "
                         "the model's weights or activations are not finite")
        self.step, self.backend = step, backend


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
