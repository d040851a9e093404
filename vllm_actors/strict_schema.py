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
  over its own names plus the common ones. A local `$ref` piece becomes an open copy of its
  target, made once per target: inline where it is first used; used again, that copy moves
  to the root's `$defs` (under a generated key) and each use refers to it. A combination
  whose pieces allow more keys (`additionalProperties` other than false,
  `patternProperties`) or use a `$ref` that cannot be opened (a cycle through pieces) is
  left as written.
- The rewrite is linear in the schema's size; one whose result would have more than
  MAX_SCHEMA_VALUES JSON values (grammar_limits.py) is refused with a ValidationError.
- Sub-schemas are followed where llguidance reads them (properties, patternProperties,
  additionalProperties, items, prefixItems, additionalItems, anyOf, oneOf, allOf, $defs,
  definitions); data (`const`, `enum`, `default`, `examples`) is never touched.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from vllm_actors.grammar_limits import MAX_SCHEMA_VALUES, count_values, refuse, resolve_local_ref

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_VALUES = ("additionalProperties", "items", "additionalItems")
_ALTERNATIVES = ("anyOf", "oneOf")


def strict_schema(schema: dict[str, Any], max_values: int = MAX_SCHEMA_VALUES) -> dict[str, Any]:
    """A copy of `schema` in which objects have only their declared keys (module doc).

    Raises ValidationError when the copy would have more than `max_values` JSON values."""
    out = copy.deepcopy(schema)
    closer = _Closer(schema, out, max_values - count_values(schema, max_values))
    closer.walk(out, part=False)
    closer.store_shared()
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
    return list(dict.fromkeys(list(props) + [r for r in required if isinstance(r, str)]))


def _branches(node: dict[str, Any], key: str) -> list[Any]:
    value = node.get(key)
    return value if isinstance(value, list) else []


def _close(node: dict[str, Any], names: list[str]) -> int:
    """Close `node` over `names`; returns the number of JSON values added."""
    added = "properties" not in node
    props = node.setdefault("properties", {})
    if not isinstance(props, dict):
        return 0   # not a schema llguidance accepts; it names the problem
    for name in names:
        if name not in props:
            props[name] = True
            added += 1
    node["additionalProperties"] = False
    return added + 1


def _num_pieces(node: dict[str, Any]) -> int:
    return (_is_object(node) + len(_branches(node, "allOf")) + ("$ref" in node)
            + any(_branches(node, key) for key in _ALTERNATIVES))


class _Closer:
    """Walks `out`, a copy of `root`, in place; `$ref` pieces are opened from the original.

    Args:
        budget: JSON values the rewrite may add before it is refused.
    """

    def __init__(self, root: dict[str, Any], out: dict[str, Any], budget: int) -> None:
        self.root = root
        self.out = out
        self.budget = budget
        self.copies: dict[str, Any] = {}   # ref -> its open copy (None while being made)
        self.pointers: dict[str, str] = {}   # ref -> the pointer to its shared copy
        self.shared: dict[str, Any] = {}   # generated $defs key -> a shared open copy
        self.by_pointer: dict[str, Any] = {}   # generated pointer -> that copy
        self.names: dict[str, list[str] | None] = {}   # generated pointer -> its names

    def _spend(self, num_values: int) -> None:
        self.budget -= num_values
        if self.budget < 0:
            raise refuse("the JSON schema made strict would have more than MAX_SCHEMA_VALUES "
                         f"= {MAX_SCHEMA_VALUES:,} values")

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
            self._open_ref(node)
        if part or "additionalProperties" in node:
            return
        if combined:
            self._close_combination(node)
        elif _is_object(node):
            names = _own_names(node, patterns=True)
            if names is not None:
                self._spend(_close(node, names))

    def _open_ref(self, node: dict[str, Any]) -> None:
        """Replace node's local `$ref` by an open copy of its target: an allOf branch in the
        ref's place (llguidance orders properties by keyword order), or appended to an
        existing allOf (so pointers into its branches stay valid)."""
        ref = node["$ref"]
        if ref in self.copies:
            piece = self._shared_piece(ref)
        else:
            target = resolve_local_ref(self.root, ref)
            if target is None:
                return
            self._spend(count_values(target, self.budget))
            self.copies[ref] = None
            piece = copy.deepcopy(target)
            self.walk(piece, part=True)
            self.copies[ref] = piece
        if piece is None:
            return   # a cycle through pieces: the ref stays as written
        self._spend(1)
        if "allOf" in node:
            del node["$ref"]
            node["allOf"] = _branches(node, "allOf") + [piece]
            return
        items = [(k, v) if k != "$ref" else ("allOf", [piece]) for k, v in node.items()]
        node.clear()
        node.update(items)

    def _shared_piece(self, ref: str) -> Any:
        """A piece referring to ref's open copy, which moves to the root's `$defs` the first
        time it is used again; None while the copy is being made or where it cannot move."""
        first = self.copies[ref]
        if not isinstance(first, dict):
            return first   # None, or a boolean schema (nothing to share)
        if ref not in self.pointers:
            defs = self.out.get("$defs", {})
            if not isinstance(defs, dict):
                return None
            base = re.sub(r"[^A-Za-z0-9_.-]", "_", ref.rsplit("/", 1)[-1])[:40] or "root"
            key, n = f"{base}.open", 1
            while key in defs or key in self.shared:
                n += 1
                key = f"{base}.open{n}"
            pointer = f"#/$defs/{key}"
            self.shared[key] = self.by_pointer[pointer] = dict(first)
            first.clear()
            first["$ref"] = self.pointers[ref] = pointer
            self._spend(2)
        self._spend(2)
        return {"$ref": self.pointers[ref]}

    def store_shared(self) -> None:
        """Put the shared open copies into the root's `$defs` (after the walk, which must
        not meet them as definitions to close)."""
        if self.shared:
            self.out.setdefault("$defs", {}).update(self.shared)

    def _declared(self, node: Any) -> list[str] | None:
        """Keys an open piece (and its own pieces) may have; None when it allows any key."""
        if not isinstance(node, dict):
            return []   # `true` / `false` declare no key
        ref = node.get("$ref")
        if isinstance(ref, str) and ref in self.by_pointer:
            if ref not in self.names:
                self.names[ref] = self._declared(self.by_pointer[ref])
            return self.names[ref]
        names = _own_names(node)
        if names is None or "$ref" in node:
            return None
        for key in ("allOf",) + _ALTERNATIVES:
            for branch in _branches(node, key):
                more = self._declared(branch)
                if more is None:
                    return None
                names += more
        return list(dict.fromkeys(names))

    def _close_combination(self, node: dict[str, Any]) -> None:
        alternatives = [key for key in _ALTERNATIVES if _branches(node, key)]
        # the owner's patternProperties hold only where the owner itself is closed
        common = _own_names(node, patterns=not alternatives)
        if "$ref" in node or common is None:
            return   # a piece we could not open, or the owner allows other keys
        for branch in _branches(node, "allOf"):
            more = self._declared(branch)
            if more is None:
                return
            common += more
        if not alternatives:
            self._spend(_close(node, common))
            return
        for key in alternatives:
            others = [self._declared({other: node[other]})
                      for other in alternatives if other != key]
            if any(o is None for o in others):
                continue   # the other alternatives allow any key
            shared = common + [n for o in others for n in o]
            for branch in _branches(node, key):
                names = self._declared(branch)
                if isinstance(branch, dict) and names is not None:
                    self._spend(_close(branch, shared + names))
