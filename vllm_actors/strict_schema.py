"""JSON schemas made strict before llguidance compiles them: an object may only have the keys
its schema declares, unless the schema says `additionalProperties` (true or a schema).

JSON Schema itself allows undeclared keys, and so does llguidance; a small model then invents
keys until max_tokens. vLLM's default backend (xgrammar) compiles schemas strictly, and its
guidance backend has `disable_additional_properties` for the same effect; this is that, with
combined objects handled so that no declared key is ever forbidden. Rules (on a copy; the
caller's schema is never changed):

- An object schema (type "object", or `properties`, `patternProperties` or `required`)
  without `additionalProperties` gets `additionalProperties: false`. Names in `required`
  that `properties` lacks are declared as `true`, so closing never makes a satisfiable
  schema unsatisfiable.
- An object combined from pieces (its own keywords, `allOf` branches, a `$ref` beside other
  keywords, `anyOf` / `oneOf` alternatives) is closed once for the combination: the pieces
  stay open (closing each would forbid the other pieces' keys). Without alternatives the
  owner is closed over every name a piece declares; with them, each alternative is closed
  over its own names plus the common ones. A local `$ref` piece is inlined as an open copy.
  A combination whose pieces allow more keys (`additionalProperties` other than false,
  `patternProperties`) or use a `$ref` that cannot be inlined is left as written.
- Sub-schemas are followed where llguidance reads them (properties, patternProperties,
  additionalProperties, items, prefixItems, additionalItems, anyOf, oneOf, allOf, $defs,
  definitions); data (`const`, `enum`, `default`, `examples`) is never touched.
"""

from __future__ import annotations

import copy
from typing import Any
from urllib.parse import unquote

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_VALUES = ("additionalProperties", "items", "additionalItems")
_ALTERNATIVES = ("anyOf", "oneOf")


def strict_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of `schema` in which objects have only their declared keys (module doc)."""
    out = copy.deepcopy(schema)
    _Closer(schema).walk(out, part=False)
    return out


def _is_object(node: dict[str, Any]) -> bool:
    kind = node.get("type")
    return kind == "object" or (isinstance(kind, list) and "object" in kind) or \
        any(k in node for k in ("properties", "patternProperties", "required"))


def _own_names(node: dict[str, Any], patterns: bool = False) -> list[str] | None:
    """Keys the node itself declares; None when it allows others (`patterns`: keys that
    match its `patternProperties` do not count as others)."""
    if ("patternProperties" in node and not patterns) or \
            node.get("additionalProperties", False) is not False:
        return None
    props = node.get("properties", {})
    required = node.get("required", [])
    if not isinstance(props, dict) or not isinstance(required, list):
        return None
    return list(props) + [r for r in required if isinstance(r, str)]


def _declared(node: Any) -> list[str] | None:
    """Keys an open piece (and its own pieces) may have; None when it allows any key."""
    if not isinstance(node, dict):
        return []   # `true` / `false` declare no key
    names = _own_names(node)
    if names is None or "$ref" in node:
        return None
    for key in ("allOf",) + _ALTERNATIVES:
        for branch in _branches(node, key):
            more = _declared(branch)
            if more is None:
                return None
            names += more
    return names


def _branches(node: dict[str, Any], key: str) -> list[Any]:
    value = node.get(key)
    return value if isinstance(value, list) else []


def _close(node: dict[str, Any], names: list[str]) -> None:
    props = node.setdefault("properties", {})
    if not isinstance(props, dict):
        return   # not a schema llguidance accepts; it names the problem
    for name in names:
        props.setdefault(name, True)
    node["additionalProperties"] = False


def _num_pieces(node: dict[str, Any]) -> int:
    return (_is_object(node) + len(_branches(node, "allOf")) + ("$ref" in node)
            + any(_branches(node, key) for key in _ALTERNATIVES))


class _Closer:
    """Walks a copy of `root` in place; `$ref` pieces are inlined from the original."""

    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self.inlining: list[str] = []   # refs being inlined (a cycle stops inlining)

    def walk(self, node: Any, part: bool) -> None:
        """Close `node` and its sub-schemas; a `part` (a piece of a combined object) is
        left open, its names closed over by the combination's owner."""
        if not isinstance(node, dict):
            return
        combined = not part and _num_pieces(node) >= 2
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                for sub in node[key].values():
                    self.walk(sub, part=False)
        for key in _SCHEMA_VALUES:
            value = node.get(key)
            for sub in value if isinstance(value, list) else [value]:
                self.walk(sub, part=False)
        for sub in _branches(node, "prefixItems"):
            self.walk(sub, part=False)
        for key in ("allOf",) + _ALTERNATIVES:
            for sub in _branches(node, key):
                self.walk(sub, part=part or combined)
        if (part or combined) and isinstance(node.get("$ref"), str):
            self._inline_ref(node)
        if part or "additionalProperties" in node:
            return
        if combined:
            self._close_combination(node)
        elif _is_object(node):
            names = _own_names(node, patterns=True)
            if names is not None:
                _close(node, names)

    def _inline_ref(self, node: dict[str, Any]) -> None:
        """Replace node's local `$ref` by an open copy of its target: an allOf branch in the
        ref's place (llguidance orders properties by keyword order), or appended to an
        existing allOf (so pointers into its branches stay valid)."""
        ref = node["$ref"]
        target = self._resolve(ref)
        if target is None or ref in self.inlining:
            return
        inlined = copy.deepcopy(target)
        self.inlining.append(ref)
        self.walk(inlined, part=True)
        self.inlining.pop()
        if "allOf" in node:
            del node["$ref"]
            node["allOf"] = _branches(node, "allOf") + [inlined]
            return
        items = [(k, v) if k != "$ref" else ("allOf", [inlined]) for k, v in node.items()]
        node.clear()
        node.update(items)

    def _resolve(self, ref: str) -> Any:
        """The target of a local JSON pointer (`#` or `#/a/b`) in the original schema."""
        if ref != "#" and not ref.startswith("#/"):
            return None
        node: Any = self.root
        for raw in ref[2:].split("/") if ref != "#" else []:
            key = unquote(raw).replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and key in node:
                node = node[key]
            elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
                node = node[int(key)]
            else:
                return None
        return node

    def _close_combination(self, node: dict[str, Any]) -> None:
        alternatives = [key for key in _ALTERNATIVES if _branches(node, key)]
        # the owner's patternProperties hold only where the owner itself is closed
        common = _own_names(node, patterns=not alternatives)
        if "$ref" in node or common is None:
            return   # a piece we could not inline, or the owner allows other keys
        for branch in _branches(node, "allOf"):
            more = _declared(branch)
            if more is None:
                return
            common += more
        if not alternatives:
            _close(node, common)
            return
        for key in alternatives:
            others = [_declared({other: node[other]}) for other in alternatives if other != key]
            if any(o is None for o in others):
                continue   # the other alternatives allow any key
            shared = common + [n for o in others for n in o]
            for branch in _branches(node, key):
                names = _declared(branch)
                if isinstance(branch, dict) and names is not None:
                    _close(branch, shared + names)
