"""Chat templates rendered the way Hugging Face transformers renders them.

A sandboxed Jinja2 environment (`ImmutableSandboxedEnvironment`, `trim_blocks`,
`lstrip_blocks`, loop controls) with transformers' globals: `raise_exception`, `strftime_now`,
and a `tojson` filter that does not HTML-escape. Compiled templates are cached per source.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from vllm_actors.errors import ValidationError


class ChatTemplateError(ValidationError):
    """The template raised (`raise_exception`) or failed to render for these messages."""


class _GenerationBlock(Extension):
    """Accepts transformers' `{% generation %}...{% endgeneration %}` marker and renders its body.

    transformers uses the marker to build an assistant-token mask; rendering is unchanged.
    """

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template error: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile once per template source.

    Raises:
        ChatTemplateError: the template is not valid Jinja2.
    """
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not compile: {e}") from None


def render_chat_template(source: str, messages: list[dict[str, Any]], *,
                         add_generation_prompt: bool = False, tools: list[Any] | None = None,
                         documents: list[Any] | None = None, **context: Any) -> str:
    """Render `messages` (OpenAI-style dicts) with `source`; `context` carries the special
    token strings (bos_token, eos_token, ...) and any template kwargs.

    Raises:
        ChatTemplateError: the template raised or could not render these messages.
    """
    template = compile_chat_template(source)
    try:
        return template.render(messages=messages, tools=tools, documents=documents,
                               add_generation_prompt=add_generation_prompt, **context)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template failed to render: {e}") from None


def read_chat_template(value: str | None) -> str | None:
    """A `--chat-template` value: a path to a template file, or the template text itself."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if len(value) < 4096 and "{" not in value and path.is_file():
        return path.read_text(encoding="utf-8")
    return value
