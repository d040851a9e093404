"""Chat templates rendered the way Hugging Face transformers renders them.

A sandboxed Jinja2 environment (`ImmutableSandboxedEnvironment`, `trim_blocks`,
`lstrip_blocks`, loop controls) with transformers' globals: `raise_exception`, `strftime_now`,
and a `tojson` filter that does not HTML-escape. Compiled templates are cached per source.

The sandbox also bounds what one rendering may cost, since a template can come from a request
(`--trust-request-chat-template`): at most RENDER_TIMEOUT_S seconds (checked at every call,
attribute lookup, repetition and every 1024 steps of a `range`), at most MAX_RENDERED_CHARS
characters of output, and no string or list repeated beyond MAX_REPEAT items.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from vllm_actors.errors import ValidationError


RENDER_TIMEOUT_S = 10.0
MAX_RENDERED_CHARS = 64 * 2**20
MAX_REPEAT = 2**20
MAX_RANGE = 100_000


class ChatTemplateError(ValidationError):
    """The template raised (`raise_exception`) or failed to render for these messages, or
    went beyond the sandbox's limits."""


_render = threading.local()   # the deadline of the rendering running on this thread


def _check_deadline() -> None:
    deadline = getattr(_render, "deadline", None)
    if deadline is not None and time.monotonic() > deadline:
        raise ChatTemplateError(f"chat template error: rendering took longer than "
                                f"{RENDER_TIMEOUT_S:.0f}s")


class _BoundedRange:
    """`range` for templates: at most MAX_RANGE items, the deadline checked as it runs."""

    def __init__(self, *args: int) -> None:
        self.items = range(*args)
        if len(self.items) > MAX_RANGE:
            raise ChatTemplateError(f"chat template error: range of {len(self.items)} items "
                                    f"(at most {MAX_RANGE})")

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: Any) -> Any:
        return self.items[index]

    def __iter__(self) -> Any:
        for i, value in enumerate(self.items):
            if i % 1024 == 0:
                _check_deadline()
            yield value


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, with the deadline checked at every call and attribute lookup, and
    repetition (`*`) and powers (`**`) bounded."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_deadline()
        if operator == "*":
            sized, count = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(sized, (str, list, tuple)) and isinstance(count, int) and \
                    len(sized) * count > MAX_REPEAT:
                raise ChatTemplateError(f"chat template error: repeating {len(sized)} items "
                                        f"{count} times (at most {MAX_REPEAT} in all)")
        if operator == "**" and isinstance(right, int) and abs(right) > 1024:
            raise ChatTemplateError(f"chat template error: exponent {right} (at most 1024)")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        _check_deadline()
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj: Any, attribute: str) -> Any:
        _check_deadline()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _check_deadline()
        return super().getitem(obj, argument)


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
    env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True,
                              extensions=[_GenerationBlock, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["range"] = _BoundedRange
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
    _render.deadline = time.monotonic() + RENDER_TIMEOUT_S
    pieces, size = [], 0
    try:
        for piece in template.generate(messages=messages, tools=tools, documents=documents,
                                       add_generation_prompt=add_generation_prompt, **context):
            size += len(piece)
            if size > MAX_RENDERED_CHARS:
                raise ChatTemplateError("chat template error: the rendered prompt is longer "
                                        f"than {MAX_RENDERED_CHARS} characters")
            pieces.append(piece)
        _check_deadline()
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template failed to render: {e}") from None
    except (ArithmeticError, MemoryError, RecursionError, TypeError, ValueError) as e:
        raise ChatTemplateError(f"chat template failed to render: {type(e).__name__}: "
                                f"{e}") from None
    finally:
        _render.deadline = None
    return "".join(pieces)


def read_chat_template(value: str | None) -> str | None:
    """A `--chat-template` value: a path to a template file, or the template text itself."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if len(value) < 4096 and "{" not in value and path.is_file():
        return path.read_text(encoding="utf-8")
    return value
