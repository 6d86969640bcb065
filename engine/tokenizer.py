"""Hugging Face tokenizer.json + tokenizer_config.json: encode, decode, chat templates, streaming."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from engine.chat_template import MAX_CHARS, MAX_SECONDS, ChatTemplate
from engine.chat_tokens import IncrementalEncoder
from engine.config import ModelConfig
from engine.errors import GDecodeError

COUNT_CHUNK = 1 << 16  # characters tokenized at a time when counting a long text
TYPICAL_TOKEN_BYTES = 8  # a text of more bytes per context token than this is counted in chunks first
CONTEXT_IDS = 4  # ids decoded before a new one, so that spacing that depends on the previous token is right


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise GDecodeError(f"{path}: not valid JSON ({e})") from None
    return d if isinstance(d, dict) else {}


def _token_text(x) -> str | None:
    # tokenizer_config.json writes special tokens as a string or as an AddedToken dict
    if isinstance(x, dict):
        x = x.get("content")
    return x if isinstance(x, str) else None


def _ids(x) -> set[int]:
    if x is None:
        return set()
    return {int(i) for i in x} if isinstance(x, (list, tuple)) else {int(x)}


def _pick_template(t, source: str) -> str | None:
    # a list of {"name", "template"} entries: take "default", else the first
    if isinstance(t, list):
        named = {e.get("name"): e.get("template") for e in t if isinstance(e, dict)}
        t = named.get("default", next(iter(named.values()), None))
    if t is not None and not isinstance(t, str):
        raise GDecodeError(f"{source}: chat_template is neither a string nor a list of named templates")
    return t


class Tokenizer:
    """A model's tokenizer: tokenizer.json through the `tokenizers` package, plus HF's config conventions."""

    def __init__(self, tok: HFTokenizer, config: dict, chat_template: str | None, eos_ids: set[int], source: str):
        self._tok = tok
        self.source = source
        self.chat_template = chat_template
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_id = tok.token_to_id(self.bos_token) if self.bos_token else None
        eos = tok.token_to_id(self.eos_token) if self.eos_token else None
        self.eos_ids: set[int] = eos_ids | ({eos} if eos is not None else set())
        self._add_bos = config.get("add_bos_token")
        # does tokenizer.json's post_processor already add BOS?
        probe = tok.encode("a", add_special_tokens=True).ids
        self._post_bos = self.bos_id is not None and probe[:1] == [self.bos_id]
        self._template = None
        self._chat_ids = IncrementalEncoder(tok)

    @classmethod
    def from_dir(cls, model_dir: str | Path, cfg: ModelConfig | None = None) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json, chat_template.jinja and generation_config.json."""
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise GDecodeError(f"{model_dir}: no tokenizer.json (only fast tokenizers are supported)")
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise GDecodeError(f"{path}: cannot load tokenizer ({why})") from None
        config = _read_json(model_dir / "tokenizer_config.json")
        jinja_file = model_dir / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        else:
            template = _pick_template(config.get("chat_template"), str(model_dir / "tokenizer_config.json"))
        gen = _read_json(model_dir / "generation_config.json")
        eos = _ids(gen.get("eos_token_id")) | set(cfg.eos_token_ids if cfg else ())
        tk = cls(tok, config, template, eos, str(model_dir))
        if tk.bos_id is None and cfg is not None and cfg.bos_token_id is not None:
            tk.bos_id = cfg.bos_token_id
        return tk

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """UTF-8 bytes of the longest token as the vocabulary writes it: no token stands for more
        bytes of text (a byte-level or sentencepiece token is written in at least as many bytes)."""
        return max((len(t.encode("utf-8")) for t in self._tok.get_vocab(with_added_tokens=True)), default=1)

    def max_text_bytes(self, max_tokens: int) -> int:
        """A text of more UTF-8 bytes than this cannot be max_tokens tokens (with a factor 2 to spare
        for normalizers that shorten text)."""
        return 2 * max_tokens * self.max_token_bytes

    def check_length(self, text: str, max_tokens: int, what: str = "the prompt") -> None:
        """Refuse a text that cannot fit max_tokens tokens without tokenizing the whole of it: first
        by its size in bytes, then, for a text of many bytes per token, by counting tokens chunk by
        chunk and stopping once the count is well past max_tokens."""
        size = len(text.encode("utf-8", "replace"))
        limit = self.max_text_bytes(max_tokens)
        if size > limit:
            raise GDecodeError(f"{what} is {size:,} bytes, more than a context of {max_tokens} tokens can hold "
                               f"with this tokenizer (at most {limit:,} bytes)")
        if size <= max(COUNT_CHUNK, TYPICAL_TOKEN_BYTES * max_tokens):
            return
        count = 0
        for piece in _chunks(text, COUNT_CHUNK):
            count += len(self._tok.encode(piece, add_special_tokens=False).ids)
            if count > max_tokens * 1.1 + 64:  # chunk edges move a count by a token or two, not 10%
                raise GDecodeError(f"{what} is over {count:,} tokens ({size:,} bytes) but the context holds "
                                   f"{max_tokens}")

    def encode(self, text: str, add_special_tokens: bool = True, max_tokens: int | None = None) -> list[int]:
        """Token ids of text; BOS is added only where the model's own tokenizer adds it. With
        max_tokens, a text that cannot fit is refused before it is tokenized (see check_length)."""
        if max_tokens is not None:
            self.check_length(text, max_tokens)
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.bos_id is not None:
            if self._add_bos is True and not self._post_bos:
                ids = [self.bos_id, *ids]
            elif self._add_bos is False and self._post_bos and ids[:1] == [self.bos_id]:
                ids = ids[1:]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            max_chars: int = MAX_CHARS, seconds: float = MAX_SECONDS, **kwargs) -> str:
        """Render messages with the model's Jinja chat template, as transformers does, in a sandbox
        bounded to `seconds` and `max_chars` characters."""
        if self.chat_template is None:
            raise GDecodeError(f"{self.source}: the model has no chat template")
        if self._template is None:
            self._template = ChatTemplate(self.chat_template, self.source)
        context = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "", **kwargs}
        return self._template.render(max_chars, seconds, messages=messages,
                                     add_generation_prompt=add_generation_prompt, **context)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    max_tokens: int | None = None) -> list[int]:
        """Rendered chat prompt as ids; the template writes its own special tokens, so none are added.
        With max_tokens, messages that cannot fit are refused before rendering, and the template may
        make at most max_text_bytes(max_tokens) characters."""
        if max_tokens is None:
            return self._chat_ids.encode(self.apply_chat_template(messages, add_generation_prompt))
        content = "".join(str(m.get("content") or "") for m in messages if isinstance(m, dict))
        self.check_length(content, max_tokens, "the messages")
        text = self.apply_chat_template(messages, add_generation_prompt, max_chars=self.max_text_bytes(max_tokens))
        self.check_length(text, max_tokens)
        # the last conversation's text up to a special token is not tokenized again (engine/chat_tokens.py)
        return self._chat_ids.encode(text)


def _chunks(text: str, size: int):
    """Pieces of about `size` characters, cut after a newline or space where there is one near the end."""
    start = 0
    while start < len(text):
        end = min(start + size, len(text))
        if end < len(text):
            cut = max(text.rfind("\n", end - 256, end), text.rfind(" ", end - 256, end))
            end = cut + 1 if cut > start else end
        yield text[start:end]
        start = end


class StreamDecoder:
    """Incremental detokenizer: push ids one at a time, get back only text that is final.

    The `tokenizers` library's DecodeStream does the work (a window of recent ids as context, so
    that spacing rules such as sentencepiece's leading space stay right, and a multi-byte character
    held back until its last byte arrives). What it lacks is `flush`: the text of ids still held
    back when generation ends. `context` ids (the prompt's last ones) are decoded before the first
    pushed id, as the text before it, and never returned.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True, context=()):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self._restart([int(i) for i in context][-CONTEXT_IDS:])

    def _restart(self, context: list[int]) -> None:
        self._context = context
        self._held = 0  # pushed ids whose text has not been returned yet
        self._stream = DecodeStream(ids=context or None, skip_special_tokens=self.skip)

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        try:
            piece = self._stream.step(self.tokenizer._tok, int(token_id))
        except Exception as e:  # the Rust side raises a bare Exception
            raise GDecodeError(f"{self.tokenizer.source}: cannot decode token {token_id} ({e})") from None
        if piece is None:
            self._held += 1
            return ""
        self._held = 0
        return piece

    def flush(self) -> str:
        """Whatever is still held back, even an incomplete character."""
        if not self._held:
            return ""
        recent = (self._context + self.ids)[-(self._held + CONTEXT_IDS):]
        before = self.tokenizer.decode(recent[: -self._held], self.skip)
        text = self.tokenizer.decode(recent, self.skip)
        self._restart(recent[-CONTEXT_IDS:])
        return text[len(before):] if text.startswith(before) else text
