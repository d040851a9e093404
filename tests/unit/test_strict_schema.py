"""Strict JSON schemas: the compiled grammar (checked with a byte-level llguidance matcher)
lets an object have only its declared keys unless the schema says additionalProperties, at
every nesting level, without forbidding keys that combined schemas declare; a request can
opt out."""

from __future__ import annotations

import copy

import pytest
from grammar_text import params_accept

from vllm_actors.sampling_params import StructuredOutputsParams
from vllm_actors.strict_schema import strict_schema

INT = {"type": "integer"}
README = {"type": "object", "properties": {"answer": INT}, "required": ["answer"]}
POINT = {"type": "object", "properties": {"x": INT, "y": INT}, "required": ["x", "y"]}
BASE = {"type": "object", "properties": {"id": INT}, "required": ["id"]}

# (schema, texts it must accept, texts it must refuse)
CASES = {
    "readme": (README, ['{"answer":2}'], ['{"answer":2,"x":1}', '{"answer":2,"answer":3}']),
    "nested": ({"type": "object", "properties": {"at": POINT}, "required": ["at"]},
               ['{"at":{"x":1,"y":2}}'], ['{"at":{"x":1,"y":2,"z":3}}',
                                           '{"at":{"x":1,"y":2},"z":3}']),
    "array of objects": ({"type": "array", "items": POINT},
                         ['[{"x":1,"y":2},{"x":3,"y":4}]'], ['[{"x":1,"y":2,"z":0}]']),
    "prefixItems": ({"type": "array", "prefixItems": [POINT]}, ['[{"x":1,"y":2}]'],
                    ['[{"x":1,"y":2,"z":0}]']),
    "$defs ref": ({"$defs": {"P": POINT}, "type": "object",
                   "properties": {"a": {"$ref": "#/$defs/P"}, "b": {"$ref": "#/$defs/P"}}},
                  ['{"a":{"x":1,"y":2}}', '{"a":{"x":1,"y":2},"b":{"x":0,"y":0}}'],
                  ['{"a":{"x":1,"y":2,"q":1}}', '{"c":1}']),
    "definitions ref": ({"definitions": {"P": POINT}, "type": "array",
                         "items": {"$ref": "#/definitions/P"}},
                        ['[{"x":1,"y":2}]'], ['[{"x":1,"y":2,"q":1}]']),
    "recursive ref": ({"$defs": {"T": {"type": "object", "properties": {
        "v": INT, "kids": {"type": "array", "items": {"$ref": "#/$defs/T"}}},
        "required": ["v"]}}, "$ref": "#/$defs/T"},
        ['{"v":1,"kids":[{"v":2}]}'], ['{"v":1,"kids":[{"v":2,"w":3}]}', '{"v":1,"w":3}']),
    "anyOf": ({"anyOf": [{"type": "object", "properties": {"a": INT}, "required": ["a"]},
                         {"type": "object", "properties": {"b": INT}, "required": ["b"]}]},
              ['{"a":1}', '{"b":1}'], ['{"a":1,"b":1}', '{"a":1,"c":1}']),
    "oneOf": ({"oneOf": [{"type": "object", "properties": {"a": INT}, "required": ["a"]},
                         {"type": "null"}]}, ['{"a":1}', "null"], ['{"a":1,"c":1}']),
    "nullable object": ({"type": "object", "properties": {
        "p": {"anyOf": [POINT, {"type": "null"}]}}, "required": ["p"]},
        ['{"p":null}', '{"p":{"x":1,"y":2}}'], ['{"p":{"x":1,"y":2,"z":3}}']),
    "additionalProperties true": (dict(README, additionalProperties=True),
                                  ['{"answer":2}', '{"answer":2,"x":[1]}'], []),
    "additionalProperties schema": (dict(README, additionalProperties=INT),
                                    ['{"answer":2,"x":1}'], ['{"answer":2,"x":"s"}']),
    "additionalProperties false": (dict(README, additionalProperties=False),
                                   ['{"answer":2}'], ['{"answer":2,"x":1}']),
    "only required": ({"type": "object", "required": ["a"]}, ['{"a":"anything"}'],
                      ['{"a":1,"b":1}', "{}"]),
    "bare object": ({"type": "object"}, ["{}"], ['{"a":1}']),
    "patternProperties": ({"type": "object", "patternProperties": {"^x_": INT}},
                          ['{"x_a":1,"x_b":2}'], ['{"y":1}', '{"x_a":"s"}']),
    "key named properties": ({"type": "object", "properties": {"properties": POINT}},
                             ['{"properties":{"x":1,"y":2}}'],
                             ['{"properties":{"x":1,"y":2,"z":3}}']),
    # allOf pieces stay open (closing each would forbid the other's keys); the whole is closed
    "allOf": ({"allOf": [{"type": "object", "properties": {"a": INT}, "required": ["a"]},
                         {"type": "object", "properties": {"b": INT}, "required": ["b"]}]},
              ['{"a":1,"b":2}'], ['{"a":1,"b":2,"c":3}', '{"a":1}']),
    "allOf with own properties": ({"type": "object", "properties": {"c": INT},
                                   "allOf": [{"properties": {"a": INT}}]},
                                  ['{"c":1,"a":2}', '{"a":2}'], ['{"c":1,"a":2,"d":3}']),
    "allOf with a $ref": ({"$defs": {"Base": BASE}, "allOf": [
        {"$ref": "#/$defs/Base"}, {"properties": {"name": {"type": "string"}}}]},
        ['{"id":1,"name":"n"}', '{"id":1}'], ['{"id":1,"name":"n","z":0}', '{"name":"n"}']),
    "$ref beside properties": ({"$defs": {"Base": BASE}, "$ref": "#/$defs/Base",
                                "properties": {"name": {"type": "string"}}},
                               ['{"id":1,"name":"n"}'], ['{"id":1,"z":0}']),
    "allOf open piece": ({"allOf": [BASE, {"additionalProperties": INT}]},
                         ['{"id":1,"z":0}'], ['{"id":1,"z":"s"}']),
    # alternatives beside the object's own keys: each closed over its keys and the common ones
    "anyOf beside properties": ({"type": "object", "properties": {"kind": {"type": "string"}},
                                 "required": ["kind"], "anyOf": [
        {"properties": {"x": INT}, "required": ["x"]},
        {"properties": {"y": INT}, "required": ["y"]}]},
        ['{"kind":"k","x":1}', '{"kind":"k","y":1}'],
        ['{"kind":"k","x":1,"z":1}', '{"kind":"k","x":1,"y":2}', '{"kind":"k"}']),
    "anyOf of required names": ({"type": "object", "properties": {"a": INT, "b": INT},
                                 "anyOf": [{"required": ["a"]}, {"required": ["b"]}]},
                                ['{"a":1}', '{"b":1}', '{"a":1,"b":2}'],
                                ['{"a":1,"c":1}', "{}"]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_undeclared_keys_are_refused(name):
    schema, good, bad = CASES[name]
    before = copy.deepcopy(schema)
    params = StructuredOutputsParams(json=schema)
    for text in good:
        assert params_accept(params, text), (name, text)
    for text in bad:
        assert not params_accept(params, text), (name, text)
    assert schema == before   # the user's schema is never changed


@pytest.mark.parametrize("strict", [None, True])
def test_strict_is_the_default_and_can_be_asked_for(strict):
    params = StructuredOutputsParams(json=README, disable_additional_properties=strict)
    assert params_accept(params, '{"answer":2}')
    assert not params_accept(params, '{"answer":2,"x":1}')


def test_opt_out_compiles_the_schema_as_written():
    params = StructuredOutputsParams(json={"type": "object", "properties": {"at": POINT}},
                                     disable_additional_properties=False)
    assert params_accept(params, '{"at":{"x":1,"y":2,"z":3},"w":[]}')
    assert params_accept(params, '{"answer":2}')
    assert not params_accept(params, '{"at":{"x":"s"}}')   # declared keys still typed


def test_whitespace_is_compact_unless_allowed():
    spaced = '{"answer": 2}'
    assert not params_accept(StructuredOutputsParams(json=README), spaced)
    assert not params_accept(StructuredOutputsParams(json=README, disable_any_whitespace=True),
                             spaced)
    assert params_accept(StructuredOutputsParams(json=README, disable_any_whitespace=False),
                         spaced)
    assert params_accept(StructuredOutputsParams(json_object=True, disable_any_whitespace=False),
                         '{"a": [1, 2]}')
    assert not params_accept(StructuredOutputsParams(json_object=True), '{"a": 1}')


def test_json_object_stays_any_object():
    assert params_accept(StructuredOutputsParams(json_object=True), '{"anything":{"goes":1}}')


def test_data_keywords_are_not_rewritten():
    data = {"properties": {"a": 1}, "required": ["b"]}
    schema = {"type": "object", "properties": {
        "c": {"const": data}, "e": {"enum": [data]}, "d": {"default": data, "type": "object"}},
        "examples": [data]}
    out = strict_schema(schema)
    props = out["properties"]
    assert props["c"]["const"] == data and props["e"]["enum"] == [data]
    assert props["d"]["default"] == data and out["examples"] == [data]
    assert props["d"]["additionalProperties"] is False and out["additionalProperties"] is False


def test_closing_adds_exactly_the_declared_names():
    out = strict_schema({"type": "object", "properties": {"a": INT}, "required": ["a", "b"]})
    assert out == {"type": "object", "properties": {"a": INT, "b": True},
                   "required": ["a", "b"], "additionalProperties": False}
    combined = strict_schema({"allOf": [{"properties": {"a": INT}}, {"required": ["b"]}]})
    assert combined == {"allOf": [{"properties": {"a": INT}}, {"required": ["b"]}],
                        "properties": {"a": True, "b": True}, "additionalProperties": False}


def test_a_ref_cycle_through_pieces_is_left_as_written():
    schema = {"$defs": {"A": {"properties": {"a": INT}, "allOf": [{"$ref": "#/$defs/A"}]}},
              "$ref": "#/$defs/A"}
    a = strict_schema(schema)["$defs"]["A"]
    inlined = a["allOf"][0]["allOf"][0]   # the first use is inlined, open ...
    assert inlined == {"properties": {"a": INT}, "allOf": [{"$ref": "#/$defs/A"}]}
    assert "additionalProperties" not in a   # ... the cycle stops there, nothing is closed
