"""Prefix reuse: how much of a new prompt a KV cache already holds."""

from __future__ import annotations


def shared_prefix(held: list[int], ids: list[int]) -> int:
    """The length of the longest common prefix of `held` and `ids`, leaving at least the last
    prompt token to run (its logits pick the first new token)."""
    n = min(len(held), len(ids) - 1)
    i = 0
    while i < n and held[i] == ids[i]:
        i += 1
    return i
