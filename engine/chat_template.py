"""Chat templates: Jinja in a sandbox, one self-contained file, rendering bounded in time and size."""

from __future__ import annotations

import ctypes
import functools
import json
import re
import string
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
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-+ #0]*(\d*)(?:\.(\d*))?")
_SIZED = (str, list, tuple, dict)
_FORMATS = ("format", "format_map")
_SIZING_FILTERS = {"do_center", "do_indent", "do_wordwrap", "do_truncate", "do_format"}


class TemplateLimit(Exception):
    """Rendering ran past its time or size bound."""


class _Overtime(BaseException):
    """Raised by the watchdog inside a render that ran past its deadline. A BaseException, so that no
    `except Exception` on the way (in jinja or in a filter) can swallow it."""


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
        overtime = f"stopped: it ran longer than {seconds:g} s"
        try:
            _WATCHDOG.arm(b.deadline)
            return self._generate(max_chars, overtime, context)
        except _Overtime:  # it fired while _generate was already raising another error
            raise self._error(overtime) from None
        finally:
            try:
                _WATCHDOG.disarm()
            except _Overtime:  # it fired on the way out; it fires once, so this second call ends cleanly
                _WATCHDOG.disarm()
                raise self._error(overtime) from None
            finally:
                b.chars, b.deadline = MAX_CHARS, float("inf")

    def _generate(self, max_chars: int, overtime: str, context: dict) -> str:
        out, n = [], 0
        try:
            for piece in self.template.generate(**context):
                n += len(piece)
                if n > max_chars:
                    raise TemplateLimit(f"its output passed the bound of {max_chars:,} characters")
                out.append(piece)
        except _Overtime:
            raise self._error(overtime) from None
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
        return "".join(out)


def _async_raise(thread_id: int, exc: type[BaseException] | None) -> None:
    """Raise `exc` in another thread at its next bytecode boundary (None clears a pending one)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc else None)


class _Watchdog:
    """One daemon thread that stops renders running past their deadline, including the loops that the
    sandbox's hooks never see (a for over a range that calls nothing). It raises _Overtime in the
    rendering thread, once per render; the render clears what is still pending before it returns. This
    costs a render nothing while it runs, where a trace function made rendering 3-4x slower.

    The raise can land at any bytecode boundary between arm() and the end of disarm(), so disarm() holds
    only a C lock (a `with` on it releases whatever happens inside) and calls nothing written in Python
    that keeps state across a call, as threading.Condition does."""

    def __init__(self):
        self.lock = threading.Lock()
        self.wake = threading.Lock()  # held while the watchdog sleeps; arm() releases it to wake it early
        self.wake.acquire()
        self.deadlines: dict[int, float] = {}  # rendering thread -> deadline, until it fires
        self.fired: set[int] = set()
        self.thread: threading.Thread | None = None

    def arm(self, deadline: float) -> None:
        with self.lock:
            self.deadlines[threading.get_ident()] = deadline
            if self.thread is None or not self.thread.is_alive():  # first use, or a forked child
                self.thread = threading.Thread(target=self._run, name="chat-template-watchdog", daemon=True)
                self.thread.start()
        if self.wake.locked():
            try:
                self.wake.release()
            except RuntimeError:  # another arm() woke it first
                pass

    def disarm(self) -> None:
        tid = threading.get_ident()
        with self.lock:
            self.deadlines.pop(tid, None)
            if tid in self.fired:
                self.fired.discard(tid)
                _async_raise(tid, None)

    def _run(self) -> None:
        while True:
            with self.lock:
                now = time.monotonic()
                for tid in [t for t, d in self.deadlines.items() if d <= now]:
                    del self.deadlines[tid]
                    self.fired.add(tid)
                    _async_raise(tid, _Overtime)
                soonest = min(self.deadlines.values(), default=None)
            self.wake.acquire(timeout=-1 if soonest is None else max(soonest - now, 0.0))


_WATCHDOG = _Watchdog()
