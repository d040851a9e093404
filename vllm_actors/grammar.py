"""Structured-output requests as llguidance grammars, shared by the frontend (which refuses a
bad schema or grammar with a 400 before the request is queued) and the engine core (which
compiles the grammar into a token matcher, see enginecore/structured_output.py).

JSON is generated compact (no free whitespace between tokens): a small model allowed free
whitespace can fill its whole budget with newlines. JSON schemas are strict: objects get only
the keys they declare unless they say `additionalProperties` (see strict_schema.py); a request
opts out with `disable_additional_properties=False` (and into free whitespace with
`disable_any_whitespace=False`).

llguidance compiles grammars by recursion in native code, where a deep enough grammar
overflows the thread's stack and kills the process. So a grammar is first measured against
grammar_limits.py (the same limits for the frontend's check and the core's compile), and
every llguidance call that builds, validates or compiles one runs on a thread of a small
pool with a large stack (`run`), whichever thread asks.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import llguidance
from llguidance.gbnf_to_lark import is_lark_syntax

from vllm_actors.errors import ValidationError
from vllm_actors.grammar_limits import (MAX_SCHEMA_CHARS, check_grammar_text, check_schema,
                                        check_text_size, refuse)
from vllm_actors.sampling_params import StructuredOutputsParams
from vllm_actors.strict_schema import strict_schema

T = TypeVar("T")

STACK_BYTES = 256 << 20   # virtual: only the pages a compile touches take memory
NUM_STACK_THREADS = 4


class _BigStackPool:
    """Daemon threads with STACK_BYTES stacks, started on first use (again after a fork).
    `threading.stack_size` is process-wide, so it is set only while they are created."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.local = threading.local()
        self.tasks: queue.SimpleQueue | None = None
        self.pid = 0

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on one of the threads; its result, or its exception raised here."""
        if getattr(self.local, "inside", False):
            return fn(*args)
        future: cf.Future = cf.Future()
        self._tasks().put((future, fn, args))
        return future.result()

    def _tasks(self) -> queue.SimpleQueue:
        with self.lock:
            if self.tasks is None or self.pid != os.getpid():
                self.tasks, self.pid = queue.SimpleQueue(), os.getpid()
                previous = threading.stack_size(STACK_BYTES)
                try:
                    for i in range(NUM_STACK_THREADS):
                        threading.Thread(target=self._serve, args=(self.tasks,), daemon=True,
                                         name=f"grammar-stack-{i}").start()
                finally:
                    threading.stack_size(previous)
            return self.tasks

    def _serve(self, tasks: queue.SimpleQueue) -> None:
        self.local.inside = True
        while True:
            future, fn, args = tasks.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:   # handed to the caller, whatever it is
                future.set_exception(e)


_POOL = _BigStackPool()


def run(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) on a big-stack thread (synchronously; on such a thread, directly)."""
    return _POOL.run(fn, *args)


def grammar_for(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (serialized) that enforces `params`.

    Raises ValidationError for a grammar beyond grammar_limits.py's limits, and when the
    schema cannot even be read as one (the grammar itself is checked by `check_grammar`)."""
    return run(_grammar_for, params)


def check_grammar(params: StructuredOutputsParams) -> str:
    """The grammar for `params`, after llguidance accepted it.

    Raises ValidationError naming the problem (a limit, or llguidance's message) for a
    grammar too large, an unsupported JSON schema, a bad regex or a grammar that does not
    parse."""
    return run(_checked_grammar, params)


def compile_matcher(tokenizer: llguidance.LLTokenizer, params: StructuredOutputsParams,
                    grammar: str | None = None) -> llguidance.LLMatcher:
    """The token matcher for `params` over `tokenizer`, compiled from `grammar` when given
    (what `check_grammar` returned for them). Raises ValidationError as `check_grammar`
    does, or with the matcher's own error."""
    return run(_compile_matcher, tokenizer, params, grammar)


def _grammar_for(params: StructuredOutputsParams) -> str:
    options = {"whitespace_flexible": params.disable_any_whitespace is False}
    if params.json is not None:
        return _schema_grammar(params.json, params.disable_additional_properties is not False,
                               options, params)
    if params.json_object:
        return _build(params, llguidance.LLMatcher.grammar_from_json_schema, {"type": "object"},
                      overrides=options)
    if params.regex is not None:
        check_text_size("regex", params.regex)
        return _build(params, llguidance.LLMatcher.grammar_from_regex, params.regex)
    if params.choice is not None:
        choices = json.dumps(params.choice)
        check_text_size("choice list (as JSON)", choices)
        return _build(params, llguidance.grammar_from, "choice", choices)
    assert params.grammar is not None
    check_grammar_text(params.grammar, gbnf=not is_lark_syntax(params.grammar))
    return _build(params, llguidance.grammar_from, "grammar", params.grammar)


def _schema_grammar(schema: dict[str, Any], strict: bool, options: dict[str, Any],
                    params: StructuredOutputsParams) -> str:
    """A JSON schema's grammar, the schema measured before and after the strict rewrite."""
    check_schema(schema)
    if strict:
        schema = _build(params, strict_schema, schema)
    text = _build(params, json.dumps, schema)
    if len(text) > MAX_SCHEMA_CHARS:
        raise refuse(f"the JSON schema has {len(text):,} characters as JSON; at most "
                     f"MAX_SCHEMA_CHARS = {MAX_SCHEMA_CHARS:,} are accepted")
    return _build(params, llguidance.LLMatcher.grammar_from_json_schema, text,
                  overrides=options)


def _build(params: StructuredOutputsParams, fn: Callable[..., T], *args: Any,
           **kwargs: Any) -> T:
    """fn(*args, **kwargs), a ValueError or TypeError it raises as a ValidationError."""
    try:
        return fn(*args, **kwargs)
    except ValidationError:
        raise
    except RecursionError:   # the limits keep Python's recursion shallow; this is a backstop
        raise refuse(f"the {params.kinds()[0]} nests too deeply to compile") from None
    except (ValueError, TypeError) as e:
        raise ValidationError(f"invalid {params.kinds()[0]}: {e}", "structured_outputs") from None


def _checked_grammar(params: StructuredOutputsParams) -> str:
    grammar = _grammar_for(params)
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValidationError(f"invalid {params.kinds()[0]}: {error.strip()}",
                              "structured_outputs")
    return grammar


def _compile_matcher(tokenizer: llguidance.LLTokenizer, params: StructuredOutputsParams,
                     grammar: str | None) -> llguidance.LLMatcher:
    if grammar is None:
        grammar = _grammar_for(params)
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    if matcher.is_error():
        raise ValidationError(f"invalid {params.kinds()[0]}: {matcher.get_error()}",
                              "structured_outputs")
    return matcher
