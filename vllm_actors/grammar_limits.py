"""Measured bounds on structured-output grammars, checked before llguidance sees one.

llguidance compiles a grammar by recursion in native code: a long enough chain of Lark rules
or of JSON-schema `$ref`s overflows the calling thread's stack and kills the whole process
(SIGSEGV), and its GBNF-to-Lark conversion (Python, holding the GIL) repeats a pass over the
grammar once per level of a rule chain. So every grammar is measured here first and refused
with a ValidationError (param "structured_outputs") that names the limit and its value:

- text: a Lark/GBNF grammar, a regex and a choice list (as JSON) have at most
  MAX_GRAMMAR_CHARS characters; this also bounds the `%json` schemas a Lark grammar embeds.
- rules (a small lexical scan; strings, regexes, character classes and comments skipped): at
  most MAX_GRAMMAR_RULES definitions, and a longest reference chain of MAX_RULE_DEPTH, each
  parenthesis level around a reference counting as one more (llguidance recurses through
  both); a reference back into the chain being followed (recursion) counts once. For GBNF,
  chain depth x symbols is at most MAX_GBNF_WORK (the conversion's cost).
- JSON schemas (also each `%json` in a Lark grammar): containers nested at most
  MAX_SCHEMA_NESTING deep as written (about llguidance's own JSON-parser limit; it also keeps
  Python's recursion in the rewrite safe) and MAX_SCHEMA_DEPTH deep with each `$ref` followed
  counting as one more level (a recursive one once); at most MAX_SCHEMA_VALUES JSON values,
  before and after the strict rewrite (strict_schema.py), and MAX_SCHEMA_CHARS characters
  once serialized.

The scan is an estimate of what llguidance does; grammar.py also runs llguidance on threads
with a large stack, which holds the worst case these limits still admit (the text size
bounds a Lark grammar's recursion, llguidance's own 50,000-step cap a schema's). Crash points,
and the time grammars at these limits take, are in docs/BENCHMARKS.md ("Grammar limits").
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from vllm_actors.errors import ValidationError

MAX_GRAMMAR_CHARS = 128 * 1024
MAX_GRAMMAR_RULES = 5_000
MAX_RULE_DEPTH = 1_000
MAX_GBNF_WORK = 250_000
MAX_SCHEMA_NESTING = 128
MAX_SCHEMA_DEPTH = 512
MAX_SCHEMA_VALUES = 50_000
MAX_SCHEMA_CHARS = 1024 * 1024

# The tokens llguidance's lexers see, where they matter here. Each matches in one pass from
# where it starts (a string left open runs to the end of its line, a Lark regex to the end
# of the text, as llguidance reads them), so the scan is linear in the text, whatever it is.
_LARK_TOKEN = re.compile(r"""
    (?P<comment>(?:\#|//)[^\n]*)
  | (?P<newline>\n)
  | (?P<skip>"(?:\\.|[^"\\\n])*"?|/(?:\\.|[^/\\])+/?|<[^<>\s]+>|@[\w\-]+)
  | (?P<embed>%(?:json|regex|llguidance)\b)
  | (?P<directive>%\w+)
  | (?P<name>!?[_?]?[a-z][_a-z0-9\-]*|_?[A-Z][_A-Z0-9\-]*)
  | (?P<open>[(\[])
  | (?P<close>[)\]])
  | (?P<other>\S)
""", re.VERBOSE)
_GBNF_TOKEN = re.compile(r"""
    (?P<skip>\#[^\n]*|\{[^}]*\}?)
  | (?P<symbol>"(?:\\.|[^"\\])*"?|\[(?:\\.|[^\]\\])*\]?|\.)
  | (?P<define>[\w\-]+[ \t]*::=)
  | (?P<name>[\w\-]+)
  | (?P<open>\()
  | (?P<close>\))
""", re.VERBOSE)
_GBNF_NAME = re.compile(r"[\w\-]+")
_SPACE = re.compile(r"\s*")
_JSON = json.JSONDecoder()


def refuse(message: str) -> ValidationError:
    """The error for a grammar beyond a limit (the caller raises it)."""
    return ValidationError(message, "structured_outputs")


def check_text_size(kind: str, text: str) -> None:
    """Raises ValidationError when `text` (a `kind`) is longer than MAX_GRAMMAR_CHARS."""
    if len(text) > MAX_GRAMMAR_CHARS:
        raise refuse(f"the {kind} has {len(text):,} characters; at most MAX_GRAMMAR_CHARS = "
                     f"{MAX_GRAMMAR_CHARS:,} are accepted")


@dataclass
class _Rule:
    refs: list[tuple[str, int]] = field(default_factory=list)   # (target, parenthesis depth)
    nesting: int = 0   # deepest parenthesis level in the body


@dataclass
class _Scan:
    rules: dict[str, _Rule] = field(default_factory=dict)
    num_definitions: int = 0
    num_symbols: int = 0
    schemas: list[Any] = field(default_factory=list)   # the values of %json


def check_grammar_text(text: str, gbnf: bool) -> None:
    """Refuse a Lark (`gbnf`: GBNF) grammar beyond the text, rule and chain limits, or one
    embedding a JSON schema beyond the schema limits. Raises ValidationError."""
    check_text_size("grammar", text)
    scan = _scan(text, gbnf)
    if scan.num_definitions > MAX_GRAMMAR_RULES:
        raise refuse(f"the grammar defines {scan.num_definitions:,} rules; at most "
                     f"MAX_GRAMMAR_RULES = {MAX_GRAMMAR_RULES:,} are accepted")
    depth = _chain_depth(scan.rules)
    if depth > MAX_RULE_DEPTH:
        raise refuse(f"the grammar's rule references nest {depth:,} levels deep; at most "
                     f"MAX_RULE_DEPTH = {MAX_RULE_DEPTH:,} are accepted")
    if gbnf and depth * scan.num_symbols > MAX_GBNF_WORK:
        raise refuse(f"the GBNF grammar's rule-reference depth x symbols is {depth:,} x "
                     f"{scan.num_symbols:,}; at most MAX_GBNF_WORK = {MAX_GBNF_WORK:,} is "
                     "accepted (its conversion takes time in proportion)")
    num_values = 0
    for schema in scan.schemas:
        num_values += check_schema(schema, MAX_SCHEMA_VALUES - num_values)


def _scan(text: str, gbnf: bool) -> _Scan:
    """Rules, the references in their bodies, and the embedded %json values of a grammar.

    A GBNF rule starts at `name ::=`; a Lark one (as llguidance parses it) at a name that is
    the first token of its line (a body continues on a line that opens with `|`)."""
    scan = _Scan()
    rule = scan.rules.setdefault("", _Rule())   # statements before the first rule
    depth, pos, line_start = 0, 0, True
    token = _GBNF_TOKEN if gbnf else _LARK_TOKEN
    while (match := token.search(text, pos)) is not None:
        kind, pos = match.lastgroup, match.end()
        if kind in ("comment", "newline"):
            line_start = line_start or kind == "newline"
            continue
        first_on_line, line_start = line_start, False
        if first_on_line and kind in ("directive", "embed"):
            rule, depth = scan.rules[""], 0   # a statement, not part of the rule above
        if kind == "define" or (kind == "name" and first_on_line and not gbnf):
            name = _GBNF_NAME.match(match.group()).group() if gbnf \
                else match.group().lstrip("!?")
            rule = scan.rules.setdefault(name, _Rule())
            scan.num_definitions += 1
            depth = 0
        elif kind == "name":
            rule.refs.append((match.group().lstrip("!?"), depth))
            scan.num_symbols += 1
        elif kind == "open":
            depth += 1
            rule.nesting = max(rule.nesting, depth)
        elif kind == "close":
            depth = max(depth - 1, 0)
        elif kind == "symbol":
            scan.num_symbols += 1
        elif kind == "embed":
            value, pos = _embedded_json(text, pos, match.group())
            if match.group() == "%json":
                scan.schemas.append(value)
    return scan


def _embedded_json(text: str, pos: int, keyword: str) -> tuple[Any, int]:
    """The JSON value after `keyword` at `pos`, and where it ends."""
    start = _SPACE.match(text, pos).end()
    try:
        return _JSON.raw_decode(text, start)
    except (ValueError, RecursionError):
        raise refuse(f"the value after {keyword} in the grammar is not valid JSON") from None


def _chain_depth(rules: dict[str, _Rule]) -> int:
    """The longest reference chain, in levels (rule bodies and parentheses), found by a
    memoized depth-first walk: a reference to a rule on the current path adds nothing."""
    height: dict[str, int] = {}
    on_path: set[str] = set()
    for root in rules:
        if root in height:
            continue
        stack, on_path = [(root, 0)], {root}
        while stack:
            name, i = stack[-1]
            refs = rules[name].refs
            if i < len(refs):
                stack[-1] = (name, i + 1)
                target = refs[i][0]
                if target in rules and target not in height and target not in on_path:
                    on_path.add(target)
                    stack.append((target, 0))
                continue
            stack.pop()
            on_path.discard(name)
            height[name] = 1 + max([rules[name].nesting] +
                                   [d + height.get(t, 0) for t, d in refs])
    return max(height.values(), default=0)


def count_values(value: Any, limit: int) -> int:
    """The number of JSON values in `value` (each container and scalar, shared ones each
    time they occur), counted up to `limit` + 1 at most."""
    return _size(value, limit)[0]


def _size(value: Any, limit: int) -> tuple[int, int]:
    """(number of values as `count_values` counts them, deepest container nesting)."""
    num, deepest, stack = 0, 0, [(value, 1)]
    while stack and num <= limit:
        item, depth = stack.pop()
        num += 1
        if isinstance(item, dict):
            item = item.values()
        elif not isinstance(item, list):
            continue
        deepest = max(deepest, depth)
        if num + len(item) > limit:
            return limit + 1, deepest
        stack.extend((v, depth + 1) for v in item)
    return num, deepest


def check_schema(schema: Any, max_values: int = MAX_SCHEMA_VALUES) -> int:
    """Refuse a JSON schema with more than `max_values` values, or nested deeper than
    MAX_SCHEMA_NESTING as written or MAX_SCHEMA_DEPTH counting `$ref`s followed; returns
    its number of values. Raises ValidationError."""
    num_values, nesting = _size(schema, max_values)
    if num_values > max_values:
        raise refuse(f"the JSON schema has more than {max_values:,} values; at most "
                     f"MAX_SCHEMA_VALUES = {MAX_SCHEMA_VALUES:,} are accepted")
    if nesting > MAX_SCHEMA_NESTING:
        raise refuse(f"the JSON schema nests {nesting:,} objects and arrays deep; at most "
                     f"MAX_SCHEMA_NESTING = {MAX_SCHEMA_NESTING:,} are accepted")
    if _schema_depth_exceeds(schema, MAX_SCHEMA_DEPTH):
        raise refuse(f"the JSON schema nests deeper than MAX_SCHEMA_DEPTH = "
                     f"{MAX_SCHEMA_DEPTH:,} levels (each $ref followed counts as a level)")
    return num_values


def _schema_depth_exceeds(root: Any, limit: int) -> bool:
    """Whether a chain of containers, `$ref`s leading to their targets, is longer than
    `limit`: a memoized depth-first walk, a `$ref` back into the current path adding
    nothing (recursive schemas are fine)."""
    if not isinstance(root, (dict, list)):
        return False
    targets: dict[str, Any] = {}
    height: dict[int, int] = {}
    on_path = {id(root)}
    stack = [(root, _children(root, root, targets), 0)]
    while stack:
        if len(stack) > limit:
            return True
        node, children, i = stack[-1]
        if i < len(children):
            stack[-1] = (node, children, i + 1)
            child = children[i]
            if id(child) not in height and id(child) not in on_path:
                on_path.add(id(child))
                stack.append((child, _children(child, root, targets), 0))
            continue
        stack.pop()
        on_path.discard(id(node))
        height[id(node)] = 1 + max((height.get(id(c), 0) for c in children), default=0)
        if height[id(node)] > limit:
            return True
    return False


def _children(node: Any, root: Any, targets: dict[str, Any]) -> list[Any]:
    """The containers directly in `node`, and the target of its `$ref` (resolved once per
    distinct ref, in `targets`)."""
    values = node.values() if isinstance(node, dict) else node
    out = [v for v in values if isinstance(v, (dict, list))]
    ref = node.get("$ref") if isinstance(node, dict) else None
    if isinstance(ref, str):
        if ref not in targets:
            targets[ref] = resolve_local_ref(root, ref)
        if isinstance(targets[ref], (dict, list)):
            out.append(targets[ref])
    return out


def resolve_local_ref(root: Any, ref: str) -> Any:
    """The target of a local JSON pointer (`#` or `#/a/b`) in `root`; None when `ref` is
    not one or leads nowhere."""
    if ref != "#" and not ref.startswith("#/"):
        return None
    node: Any = root
    for raw in ref[2:].split("/") if ref != "#" else []:
        key = unquote(raw).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return None
    return node
