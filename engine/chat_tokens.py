"""Chat prompts tokenized incrementally. A conversation's next prompt repeats the last one's text, so only
what follows the last special token the two texts share is tokenized again.

This is exact where the tokenizer cuts its input at special tokens and runs each piece through the rest
of its pipeline on its own, which `tokenizers` does for added tokens that are not normalized and strip
no whitespace, with a byte-level pre-tokenizer. Other tokenizers (sentencepiece's Metaspace) always
tokenize the whole text.
"""

from __future__ import annotations

import json
from bisect import bisect_right

from tokenizers import Tokenizer as HFTokenizer


def _byte_level(node) -> bool:
    """Is this a byte-level pre-tokenizer (GPT-2, Llama 3, Qwen 2, SmolLM2), alone or in a sequence, with no
    Metaspace beside it? Only those are cut: sentencepiece's Metaspace treats a piece differently by its
    place in the input (measured: its default scheme too gives other ids for a piece tokenized alone)."""
    if not isinstance(node, dict):
        return False
    kinds = [node.get("type")] + [p.get("type") for p in node.get("pretokenizers") or [] if isinstance(p, dict)]
    return "ByteLevel" in kinds and "Metaspace" not in kinds


def shared_length(a: str, b: str) -> int:
    """The length of the longest common prefix of a and b (string compares in C, log n of them)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class IncrementalEncoder:
    """Encodes texts without special tokens added (as a rendered chat prompt is), remembering the last
    text, its ids and the cuts after each special token in it. Safe to share between threads: a call
    reads the remembered state once and replaces it whole."""

    def __init__(self, tok: HFTokenizer):
        self._tok = tok
        spec = json.loads(tok.to_str())
        added = spec.get("added_tokens") or []
        cuts = {a["id"] for a in added
                if a.get("special") and not (a.get("normalized") or a.get("lstrip") or a.get("rstrip")
                                             or a.get("single_word"))}
        texts = [a.get("content") or "" for a in added]
        # a special token that begins another added token could be matched longer past a cut
        nested = any(t != u and u.startswith(t) for t in texts for u in texts) if len(texts) < 2000 else True
        self.exact = bool(cuts) and not nested and _byte_level(spec.get("pre_tokenizer"))
        self._cut_ids = frozenset(cuts)
        # (text, ids, cut_chars, cut_ids): cut i ends at character cut_chars[i], after cut_ids[i] ids
        self._last: tuple[str, list[int], list[int], list[int]] = ("", [], [], [])

    def encode(self, text: str) -> list[int]:
        if not self.exact:
            return self._tok.encode(text, add_special_tokens=False).ids
        last_text, last_ids, cut_chars, cut_ids = self._last
        k = bisect_right(cut_chars, shared_length(last_text, text))
        char0, n0 = (cut_chars[k - 1], cut_ids[k - 1]) if k else (0, 0)
        enc = self._tok.encode(text[char0:], add_special_tokens=False)
        ids = last_ids[:n0] + enc.ids
        chars, counts = cut_chars[:k], cut_ids[:k]
        for i, (tid, (_, end)) in enumerate(zip(enc.ids, enc.offsets, strict=True)):
            if tid in self._cut_ids:
                chars.append(char0 + end)
                counts.append(n0 + i + 1)
        self._last = (text, ids, chars, counts)
        return list(ids)
