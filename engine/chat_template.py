"""Chat templates: Jinja in a sandbox, one self-contained file, rendering bounded in time and size."""

from __future__ import annotations

import functools
import json
import re
import string
import sys
import threading
import time
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.filters
import jinja2.nodes
import jinja2.sandbox

from engine.errors import GDecodeError

MAX_SECONDS = 2.0  # real templates render in milliseconds
MAX_CHARS = 1 << 24  # a rendered prompt, or any string or list made on the way to it
_TRACE_EVERY = 256  # line events between two looks at the clock
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-+ #0]*(\d*)(?:\.(\d*))?")
_SIZED = (str, list, tuple, dict)
_FORMATS = ("format", "format_map")
_SIZING_FILTERS = {"do_center", "do_indent", "do_wordwrap", "do_truncate", "do_format"}


class TemplateLimit(Exception):
    """Rendering ran past its time or size bound."""


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _Bounds(threading.local):
    chars = MAX_CHARS
    seconds = MAX_SECONDS
    deadline = float("inf")


class _BoundedEnvironment(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """Every value that passes through an attribute, item, call, filter or operator is checked
    against the size bound, and numbers that would size a string (widths, repeat counts) before
    the string is made."""

    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def __init__(self):
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        self.bounds = _Bounds()
        self.filters["tojson"] = _tojson
        self.filters = {name: self._bounded(f) for name, f in self.filters.items()}
        self.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)

    def check(self, value):
        b = self.bounds
        if isinstance(value, _SIZED) and len(value) > b.chars:
            raise TemplateLimit(f"it built a value of {len(value):,} items, over the bound of {b.chars:,}")
        if time.monotonic() > b.deadline:
            raise TemplateLimit(f"it ran longer than {b.seconds:g} s")
        return value

    def check_sizes(self, *args):
        """Refuse a number that would size a huge string (a width, a repeat count)."""
        for a in args:
            if isinstance(a, int) and abs(a) > self.bounds.chars:
                raise TemplateLimit(f"a size of {a:,} is over the bound of {self.bounds.chars:,}")

    def check_format(self, fmt: str, percent: bool) -> None:
        """Refuse a width or precision over the bound in a %-format or a str.format string."""
        if percent:
            numbers = [n for m in _PERCENT_SPEC.finditer(fmt) for n in m.groups() if n]
        else:
            try:
                specs = [spec for _, _, spec, _ in string.Formatter().parse(fmt) if spec]
            except ValueError:
                return  # str.format raises the same error itself
            numbers = [n for spec in specs for n in re.findall(r"\d+", spec)]
        if any(len(n) > 12 or int(n) > self.bounds.chars for n in numbers):
            raise TemplateLimit("a format width or precision is over the size bound")

    def _bounded(self, f):
        @functools.wraps(f)
        def bounded(*args, **kwargs):
            if f.__name__ in _SIZING_FILTERS:
                self.check_sizes(*args, *kwargs.values())
            if f is jinja2.filters.do_format and args and isinstance(args[0], str):
                self.check_format(args[0], percent=True)
            return self.check(f(*args, **kwargs))

        return bounded

    def call_binop(self, context, operator, left, right):
        if operator == "**" and isinstance(right, (int, float)) and abs(right) > 256:
            raise TemplateLimit(f"the power ** {right} is over the bound")
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, _SIZED) and isinstance(n, int) and len(seq) * n > self.bounds.chars:
                    raise TemplateLimit(f"repeating {len(seq):,} items {n:,} times is over the size bound")
        if operator == "%" and isinstance(left, str):
            self.check_format(left, percent=True)
        return self.check(super().call_binop(context, operator, left, right))

    def getattr(self, obj, attribute):
        if isinstance(obj, str) and attribute in _FORMATS:
            self.check_format(obj, percent=False)  # "{:999999999}".format(x)
        return self.check(super().getattr(obj, attribute))

    def getitem(self, obj, argument):
        return self.check(super().getitem(obj, argument))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own signature)
        for a in (*args, *kwargs.values()):
            __self.check(a)
        if isinstance(getattr(__obj, "__self__", None), str):  # "a".center(10**10), "a".zfill(...)
            __self.check_sizes(*args, *kwargs.values())
        return __self.check(super().call(__context, __obj, *args, **kwargs))


_UNSUPPORTED = {jinja2.nodes.Include: "include", jinja2.nodes.Import: "import",
                jinja2.nodes.FromImport: "from ... import", jinja2.nodes.Extends: "extends"}


class ChatTemplate:
    """A compiled chat template; `where` names its file in every error."""

    def __init__(self, source: str, where: str):
        self.where = where
        self.env = _BoundedEnvironment()
        try:
            tree = self.env.parse(source)
            for node in tree.find_all(tuple(_UNSUPPORTED)):
                raise self._error(f"{{% {_UNSUPPORTED[type(node)]} %}} (line {node.lineno}) is not supported: "
                                  "a chat template must be one self-contained template")
            self.template = self.env.from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise self._error(f"syntax error on line {e.lineno}: {e.message}") from None
        except (RecursionError, MemoryError):
            raise self._error("the template is too deeply nested") from None

    def _error(self, why: str) -> GDecodeError:
        return GDecodeError(f"{self.where}: chat template: {why}")

    def render(self, max_chars: int = MAX_CHARS, seconds: float = MAX_SECONDS, **context) -> str:
        """The rendered text; a template that runs past `seconds` or makes more than `max_chars`
        characters (in its output or any value on the way) is stopped with a GDecodeError."""
        b = self.env.bounds
        b.chars, b.seconds, b.deadline = max_chars, seconds, time.monotonic() + seconds
        out, n = [], 0
        previous = sys.gettrace()
        sys.settrace(_clock_tracer(b.deadline, seconds))
        try:
            for piece in self.template.generate(**context):
                n += len(piece)
                if n > max_chars:
                    raise TemplateLimit(f"its output passed the bound of {max_chars:,} characters")
                out.append(piece)
        except TemplateLimit as e:
            raise self._error(f"stopped: {e}") from None
        except jinja2.exceptions.TemplateError as e:
            raise self._error(str(e.message or e)) from None
        except RecursionError:
            raise self._error("stopped: it recursed too deeply") from None
        except MemoryError:
            raise self._error("stopped: out of memory") from None
        except Exception as e:  # a template error of any other kind (a TypeError on bad operands, ...)
            raise self._error(f"{type(e).__name__}: {e}") from None
        finally:
            sys.settrace(previous)
            b.chars, b.deadline = MAX_CHARS, float("inf")
        return "".join(out)


def _clock_tracer(deadline: float, seconds: float):
    """A trace function that stops a template the sandbox's hooks do not see running: it looks at the clock
    every _TRACE_EVERY calls of any Python function. Lines are not traced (that made rendering 5x slower);
    a loop that calls nothing runs over at most the sandbox's range of items, and nesting another loop in
    it takes a call."""
    count = 0

    def on_call(frame, event, arg):
        nonlocal count
        count += 1
        if count % _TRACE_EVERY == 0 and time.monotonic() > deadline:
            raise TemplateLimit(f"it ran longer than {seconds:g} s")

    return on_call
