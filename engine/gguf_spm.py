"""A sentencepiece vocabulary (tokenizer.ggml.model "llama") rebuilt for the `tokenizers` library.

llama.cpp tokenizes such a vocabulary by merging, again and again, the adjacent pair whose join is
the vocabulary token of highest score; pieces left outside the vocabulary become <0xXX> byte tokens.
That is BPE whose merges are every split of every token into two vocabulary tokens, ranked by the
score of the joined token, with byte fallback; spaces are spelled "▁", with one in front of the text
and after each special token.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, normalizers

from engine.errors import GDecodeError

SPACE = "\u2581"


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every (left, right) split of a token into two vocabulary tokens, best first.

    The order is the score of the joined token (highest first); among equal scores a longer left
    piece, then a longer right piece, first; then vocabulary order.
    """
    ids: dict[str, int] = {}
    for i, t in enumerate(tokens):
        ids[t] = i  # a repeated token keeps its last id, as a dict built from the list does
    found = []
    for token, score in zip(tokens, scores, strict=True):
        pairs = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in ids and token[k:] in ids]
        pairs.sort(key=lambda p: (ids[p[0]], ids[p[1]]))
        found += [(score, a, b) for a, b in pairs]
    # a stable sort: ties keep vocabulary order, then the order of the pieces' ids
    found.sort(key=lambda m: (-m[0], -len(m[1]), -len(m[2])))
    return [(a, b) for _, a, b in found]


def spm_tokenizer(tokens: list[str], scores: list[float], unk: str | None, add_space_prefix: bool) -> Tokenizer:
    """BPE with merges from scores, byte fallback, Metaspace pre-tokenizer and the matching decoder."""
    vocab = {t: i for i, t in enumerate(tokens)}
    missing = [f"<0x{b:02X}>" for b in range(256) if f"<0x{b:02X}>" not in vocab]
    if missing:
        raise GDecodeError(f"no byte fallback token {missing[0]} in the sentencepiece vocabulary")
    try:
        bpe = models.BPE(vocab=vocab, merges=merges_from_scores(tokens, scores), unk_token=unk,
                         fuse_unk=True, byte_fallback=True)
    except Exception as e:  # the Rust side raises a bare Exception
        raise GDecodeError(f"cannot build the sentencepiece model ({str(e).splitlines()[0]})") from None
    tok = Tokenizer(bpe)
    # llama.cpp puts the space in front of every stretch of text, also one after a special token or
    # one that starts with a space, as sentencepiece does; a normalizer does that per stretch
    # (a Metaspace pre-tokenizer would skip both cases)
    steps = [normalizers.Replace(" ", SPACE)]
    if add_space_prefix:
        steps.insert(0, normalizers.Prepend(SPACE))
    tok.normalizer = normalizers.Sequence(steps)
    decode = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        decode.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(decode)
    return tok
