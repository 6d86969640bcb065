import numpy as np


class GDecodeError(Exception):
    """A user-facing error: the CLI prints its message on one line and exits non-zero."""


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
