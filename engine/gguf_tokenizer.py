"""Rebuild tokenizer.json and tokenizer_config.json from a GGUF file's vocabulary (byte-level BPE or
sentencepiece)."""

from __future__ import annotations

from gguf import GGUFReader
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from engine.errors import GDecodeError
from engine.gguf_config import Metadata, read_metadata
from engine.gguf_mmap import GGUFFile
from engine.gguf_spm import spm_tokenizer

# llama.cpp's split regexes (llama-vocab.cpp), in the spelling of the models' own tokenizer.json
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> pre-tokenizer family
PRE_TOKENIZERS = {
    "gpt-2": "gpt2",
    "smollm": "digits",
    "starcoder": "digits",
    "refact": "digits",
    "llama3": "llama3",
    "llama-v3": "llama3",
    "llama-bpe": "llama3",
    "falcon3": "llama3",
    "qwen2": "qwen2",
    "deepseek-r1-qwen": "qwen2",
}

CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type


def _byte_alphabet() -> dict[int, str]:
    # GPT-2's printable spelling of the 256 byte values
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelled, n = {}, 0
    for b in range(256):
        if b in keep:
            spelled[b] = chr(b)
        else:
            spelled[b] = chr(256 + n)
            n += 1
    return spelled


def _pre_tokenizer(family: str):
    if family == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if family == "digits":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    split = _LLAMA3_SPLIT if family == "llama3" else _QWEN2_SPLIT
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def check_tokenizer(meta: dict, source: str) -> str:
    """The tokenizer family of a GGUF ("spm" or a byte-level pre-tokenizer family); raises GDecodeError
    when the file's tokenizer cannot be rebuilt or its metadata is malformed."""
    m = Metadata(meta, source)
    model = m.str("tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise GDecodeError(
            f"{source}: tokenizer model {model!r} is not supported "
            "(supported: 'gpt2', byte-level BPE; 'llama', sentencepiece)"
        )
    tokens = m.strings("tokenizer.ggml.tokens")
    if not tokens:
        raise GDecodeError(f"{source}: no tokenizer.ggml.tokens in the file")
    m.numbers("tokenizer.ggml.token_type", int, len(tokens))
    for key in ("bos", "eos", "eot", "eom", "unknown", "padding"):
        m.int(f"tokenizer.ggml.{key}_token_id", lo=0, hi=len(tokens) - 1)
    for key in ("add_bos_token", "add_eos_token", "add_space_prefix"):
        m.bool(f"tokenizer.ggml.{key}", False)
    m.str("tokenizer.chat_template")
    if model == "llama":
        if m.numbers("tokenizer.ggml.scores", float, len(tokens)) is None:
            raise GDecodeError(f"{source}: no tokenizer.ggml.scores in the file (sentencepiece needs them)")
        return "spm"
    if not m.strings("tokenizer.ggml.merges"):
        raise GDecodeError(f"{source}: no tokenizer.ggml.merges in the file")
    pre = m.str("tokenizer.ggml.pre", "gpt-2")
    if pre not in PRE_TOKENIZERS:
        names = ", ".join(sorted(PRE_TOKENIZERS))
        raise GDecodeError(f"{source}: pre-tokenizer {pre!r} is not supported (supported: {names})")
    return PRE_TOKENIZERS[pre]


def tokenizer_from_gguf(reader: GGUFFile | GGUFReader, source: str = "GGUF file") -> tuple[Tokenizer, dict]:
    """The tokenizer a parsed GGUF file (engine.gguf_mmap.read_gguf) describes, as a `tokenizers.Tokenizer`
    and the tokenizer_config.json dict (special tokens, BOS/EOS flags, chat template); GDecodeError when
    it cannot be rebuilt."""
    meta = read_metadata(reader)
    tok = build_tokenizer(meta, source)
    ctx = meta.get(f"{meta.get('general.architecture')}.context_length")
    return tok, tokenizer_config(meta, ctx if type(ctx) is int and ctx > 0 else None)


def build_tokenizer(meta: dict, source: str) -> Tokenizer:
    """tokenizer.json: the file's vocabulary and merges (or scores), its pre-tokenizer, its control
    tokens as specials."""
    family = check_tokenizer(meta, source)
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if family == "spm":
        unk = _token(meta, tokens, "unknown")
        space = meta.get("tokenizer.ggml.add_space_prefix", True)
        try:
            tok = spm_tokenizer(tokens, meta["tokenizer.ggml.scores"], unk and unk[0], space)
        except GDecodeError as e:
            raise GDecodeError(f"{source}: {e}") from None
        special = [t for t, k in zip(tokens, types, strict=True) if k == CONTROL]
        user = [t for t, k in zip(tokens, types, strict=True) if k == USER_DEFINED]
    else:
        tok, special, user = _byte_level(meta, tokens, types, family, source)
    tok.post_processor = _post_processor(meta, tokens, family)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    return tok


def _byte_level(meta: dict, tokens: list[str], types: list[int], family: str, source: str):
    alphabet = _byte_alphabet()
    letters = set(alphabet.values())
    # a token spelled outside the byte alphabet is stored as raw text: spell its UTF-8 bytes
    vocab = {
        t if set(t) <= letters else "".join(alphabet[b] for b in t.encode("utf-8")): i for i, t in enumerate(tokens)
    }
    merges = []
    for m in meta["tokenizer.ggml.merges"]:
        a, sep, b = m.partition(" ")
        if not sep:
            raise GDecodeError(f"{source}: malformed merge {m!r}")
        merges.append((a, b))
    try:
        bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=family == "llama3")
    except Exception as e:  # the Rust side raises a bare Exception
        raise GDecodeError(f"{source}: cannot build the BPE model ({str(e).splitlines()[0]})") from None
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = _pre_tokenizer(family)
    tok.decoder = decoders.ByteLevel()
    # control tokens spelled outside the alphabet are mislabels (llama.cpp): leave them in the vocab only
    special = [t for t, k in zip(tokens, types, strict=True) if k == CONTROL and set(t) <= letters]
    user = [t for t, k in zip(tokens, types, strict=True) if k == USER_DEFINED and t in vocab]
    return tok, special, user


def _add_bos(meta: dict, family: str) -> bool:
    # llama.cpp adds BOS for sentencepiece and Llama 3 vocabularies unless the file says otherwise
    return bool(meta.get("tokenizer.ggml.add_bos_token", family in ("llama3", "spm")))


def _post_processor(meta: dict, tokens: list[str], family: str):
    bos = _token(meta, tokens, "bos") if _add_bos(meta, family) else None
    eos = _token(meta, tokens, "eos") if meta.get("tokenizer.ggml.add_eos_token", False) else None
    if bos is None and eos is None:
        return processors.ByteLevel(trim_offsets=False) if family != "spm" else None

    def seq(piece: str, type_id: int) -> list[str]:
        return [f"{t}:{type_id}" for t in (bos and bos[0], piece, eos and eos[0]) if t]

    return processors.TemplateProcessing(
        single=seq("$A", 0),
        pair=seq("$A", 0) + seq("$B", 1),
        special_tokens=[t for t in (bos, eos) if t],
    )


def _token(meta: dict, tokens: list[str], name: str) -> tuple[str, int] | None:
    i = meta.get(f"tokenizer.ggml.{name}_token_id")
    if i is None or not 0 <= i < len(tokens):
        return None
    return tokens[i], int(i)


def tokenizer_config(meta: dict, max_length: int | None) -> dict:
    """tokenizer_config.json: special tokens, BOS/EOS flags and the chat template."""
    tokens = meta["tokenizer.ggml.tokens"]
    family = check_tokenizer(meta, "GGUF file")
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": _add_bos(meta, family),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
    }
    if max_length is not None:
        cfg["model_max_length"] = max_length
    for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        t = _token(meta, tokens, key)
        if t is not None:
            cfg[f"{name}_token"] = t[0]
    template = meta.get("tokenizer.chat_template")
    if template:
        cfg["chat_template"] = template
    return cfg
