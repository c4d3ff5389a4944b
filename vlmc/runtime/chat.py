"""Chat templates: render the source's Jinja chat template for a plain prompt, as transformers does.

jinja2 is used directly (transformers renders with it too); the environment is set up like transformers'
(sandboxed, trim_blocks/lstrip_blocks, loop controls, a ``generation`` block, ``tojson`` without HTML
escaping, ``raise_exception``, ``strftime_now``), so a template renders to the same text in both.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import re
import signal
import threading
import time
from datetime import datetime

from vlmc import limits
from vlmc.errors import VlmcError

logger = logging.getLogger(__name__)


def user_message(prompt: str, n_images: int) -> list[dict]:
    """The conversation a plain prompt stands for: one user turn, its images first, then the text."""
    return [{"role": "user", "content": [{"type": "image"}] * n_images + [{"type": "text", "text": prompt}]}]


@functools.lru_cache(maxsize=8)
def _compile(template: str):
    try:
        import jinja2
        from jinja2 import nodes
        from jinja2.ext import Extension
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ModuleNotFoundError as exc:
        raise VlmcError("rendering the package's chat template needs jinja2: pip install jinja2") from exc

    class _Generation(Extension):
        # transformers marks assistant text with {% generation %}; rendering just emits the body.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def _raise(message):
        raise jinja2.exceptions.TemplateError(message)

    def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    class _BoundedEnvironment(ImmutableSandboxedEnvironment):
        # Every call (functions, methods) and binary * / ** goes through the work budget.
        intercepted_binops = frozenset(["*", "**"])

        def call(self, context, obj, /, *args, **kwargs):
            _tick()
            _check_args(args, kwargs)
            if getattr(obj, "__name__", "") in ("format", "format_map"):
                bound = getattr(obj, "__wrapped__", obj)  # the sandbox wraps str.format
                _check_format(getattr(bound, "__self__", None))
            return super().call(context, obj, *args, **kwargs)

        def call_binop(self, context, operator, left, right):
            _tick()
            _check_binop(operator, left, right)
            return super().call_binop(context, operator, left, right)

    env = _BoundedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    for fname, f in list(env.filters.items()):
        env.filters[fname] = _bounded_filter(f)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["range"] = _BoundedRange
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateError as exc:
        raise VlmcError(f"the package's chat template does not parse: {exc}") from exc


class _Budget(threading.local):
    steps = 0
    deadline = math.inf


_budget = _Budget()


class TemplateLimit(Exception):
    """A chat template ran past a bound (steps, time, output size)."""


def _tick(n: int = 1) -> None:
    _budget.steps += n
    if _budget.steps > limits.MAX_TEMPLATE_STEPS:
        raise TemplateLimit(f"more than {limits.MAX_TEMPLATE_STEPS} steps (VLMC_MAX_TEMPLATE_STEPS)")
    if _budget.steps % 256 == 0 and time.monotonic() > _budget.deadline:
        raise TemplateLimit(f"more than {limits.MAX_TEMPLATE_SECONDS} s (VLMC_MAX_TEMPLATE_SECONDS)")


def _check_args(args, kwargs) -> None:
    """Refuse a numeric argument that would size an allocation past the output bound (center, ljust, ...)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > limits.MAX_TEMPLATE_OUTPUT_CHARS:
            raise TemplateLimit(f"argument {a} is above {limits.MAX_TEMPLATE_OUTPUT_CHARS}")


def _check_format(spec) -> None:
    """A format string whose width or precision would allocate past the output bound."""
    if isinstance(spec, str) and re.search(r"[%:.<>^=+ #0-9-]\d{7,}", spec):
        raise TemplateLimit("a format width or precision of seven or more digits")


def _check_binop(operator: str, left, right) -> None:
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                if len(seq) * max(n, 0) > limits.MAX_TEMPLATE_OUTPUT_CHARS:
                    raise TemplateLimit(f"a repetition of {len(seq)} x {n} items")
    elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(right) > 256:
        raise TemplateLimit(f"a power with exponent {right}")


def _bounded_filter(f):
    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        _tick()
        _check_args(args[1:], kwargs)
        if f.__name__ == "do_format":
            _check_format(next((a for a in args if isinstance(a, str)), None))
        return f(*args, **kwargs)

    return wrapper


class _BoundedRange:
    """range() for templates: iterating it spends the step budget (a nested range loop cannot run for ever)."""

    MAX = 100_000  # jinja's sandbox bound for one range

    def __init__(self, *args):
        self.r = range(*args)
        if len(self.r) > self.MAX:
            raise TemplateLimit(f"range of {len(self.r)} items (at most {self.MAX})")

    def __iter__(self):
        for i in self.r:
            _tick()
            yield i

    def __reversed__(self):
        return iter(_BoundedRange(self.r.start, self.r.stop, self.r.step)[::-1])

    def __len__(self):
        return len(self.r)

    def __getitem__(self, i):
        return self.r[i] if isinstance(i, int) else list(self.r[i])

    def __contains__(self, x):
        return x in self.r


@contextlib.contextmanager
def _alarm(seconds: float):
    """On the main thread, also interrupt a render stuck inside one long step (SIGALRM)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def handler(signum, frame):
        raise TemplateLimit(f"more than {limits.MAX_TEMPLATE_SECONDS} s (VLMC_MAX_TEMPLATE_SECONDS)")

    previous = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def render(template: str, prompt: str | list[dict], n_images: int, special_tokens: dict | None = None) -> str:
    """The text transformers' apply_chat_template(..., add_generation_prompt=True, tokenize=False) gives.

    ``prompt`` is a plain prompt (one user turn, :func:`user_message`) or a whole conversation in
    transformers' message format (content parts ``{"type": "text", "text": ...}`` / ``{"type": "image"}``).

    The render is bounded (vlmc/limits.py): total loop steps and calls, seconds, and output characters;
    past a bound it is refused with one line instead of running on.
    """
    import jinja2

    compiled = _compile(template)
    _budget.steps, _budget.deadline = 0, time.monotonic() + limits.MAX_TEMPLATE_SECONDS
    out: list[str] = []
    size = 0
    try:
        with _alarm(limits.MAX_TEMPLATE_SECONDS + 0.5):
            for chunk in compiled.generate(
                messages=prompt if isinstance(prompt, list) else user_message(prompt, n_images),
                tools=None,
                documents=None,
                add_generation_prompt=True,
                **(special_tokens or {}),
            ):
                size += len(chunk)
                if size > limits.MAX_TEMPLATE_OUTPUT_CHARS:
                    raise TemplateLimit(
                        f"output above {limits.MAX_TEMPLATE_OUTPUT_CHARS} characters (VLMC_MAX_TEMPLATE_OUTPUT_CHARS)"
                    )
                out.append(chunk)
                _tick()
    except TemplateLimit as exc:
        raise VlmcError(f"the package's chat template (text.chat_template) ran past a bound: {exc}") from None
    except jinja2.exceptions.TemplateError as exc:
        raise VlmcError(f"the package's chat template failed to render: {exc}") from exc
    except (TypeError, ValueError, OverflowError, RecursionError, MemoryError, ArithmeticError) as exc:
        raise VlmcError(
            f"the package's chat template (text.chat_template) failed to render: {type(exc).__name__}: {exc}"
        ) from None
    finally:
        _budget.deadline = math.inf
    return "".join(out)
