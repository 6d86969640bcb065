"""Hugging Face tokenizer.json + tokenizer_config.json: encode, decode, chat templates, streaming."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer

from engine.config import ModelConfig
from engine.errors import GDecodeError


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


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


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

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text; BOS is added only where the model's own tokenizer adds it."""
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.bos_id is not None:
            if self._add_bos is True and not self._post_bos:
                ids = [self.bos_id, *ids]
            elif self._add_bos is False and self._post_bos and ids[:1] == [self.bos_id]:
                ids = ids[1:]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render messages with the model's Jinja chat template, as transformers does."""
        if self.chat_template is None:
            raise GDecodeError(f"{self.source}: the model has no chat template")
        try:
            if self._template is None:
                env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                    trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
                )
                env.filters["tojson"] = _tojson
                env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
                self._template = env.from_string(self.chat_template)
            context = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "", **kwargs}
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **context)
        except jinja2.exceptions.TemplateError as e:
            raise GDecodeError(f"{self.source}: chat template: {e.message or e}") from None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Rendered chat prompt as ids; the template writes its own special tokens, so none are added."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)


class StreamDecoder:
    """Incremental detokenizer: push ids one at a time, get back only text that is final.

    Text is decoded over a short window of recent ids (so spacing rules that depend on the
    previous token stay right) and held back while it ends in U+FFFD, i.e. while a multi-byte
    character is still split across tokens.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # window start: ids already emitted, kept as context
        self._read = 0  # ids before this have been emitted

    def _pending(self) -> tuple[str, str]:
        decode = self.tokenizer.decode
        before = decode(self.ids[self._prefix : self._read], self.skip)
        return before, decode(self.ids[self._prefix :], self.skip)

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        before, text = self._pending()
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return text[len(before) :]

    def flush(self) -> str:
        """Whatever is still held back, even an incomplete character."""
        before, text = self._pending()
        self._prefix = self._read = len(self.ids)
        return text[len(before) :]
