"""Chat templates: render the source's Jinja chat template for a plain prompt, as transformers does.

jinja2 is used directly (transformers renders with it too); the environment is set up like transformers'
(sandboxed, trim_blocks/lstrip_blocks, loop controls, a ``generation`` block, ``tojson`` without HTML
escaping, ``raise_exception``, ``strftime_now``), so a template renders to the same text in both.
"""

from __future__ import annotations

import functools
import json
import logging
from datetime import datetime

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

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateError as exc:
        raise VlmcError(f"the package's chat template does not parse: {exc}") from exc


def render(template: str, prompt: str, n_images: int, special_tokens: dict | None = None) -> str:
    """The text transformers' apply_chat_template(..., add_generation_prompt=True, tokenize=False) gives."""
    import jinja2

    try:
        return _compile(template).render(
            messages=user_message(prompt, n_images),
            tools=None,
            documents=None,
            add_generation_prompt=True,
            **(special_tokens or {}),
        )
    except jinja2.exceptions.TemplateError as exc:
        raise VlmcError(f"the package's chat template failed to render: {exc}") from exc
