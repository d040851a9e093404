"""Structured-output requests as llguidance grammars, shared by the frontend (which refuses a
bad schema or grammar with a 400 before the request is queued) and the engine core (which
compiles the grammar into a token matcher, see enginecore/structured_output.py).

JSON is generated compact (no free whitespace between tokens): a small model allowed free
whitespace can fill its whole budget with newlines. JSON schemas are strict: objects get only
the keys they declare unless they say `additionalProperties` (see strict_schema.py); a request
opts out with `disable_additional_properties=False` (and into free whitespace with
`disable_any_whitespace=False`).
"""

from __future__ import annotations

import json

import llguidance

from vllm_actors.errors import ValidationError
from vllm_actors.sampling_params import StructuredOutputsParams
from vllm_actors.strict_schema import strict_schema


def grammar_for(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (serialized) that enforces `params`.

    Raises ValidationError when the schema cannot even be read as one (the grammar itself
    is checked by `check_grammar`)."""
    options = {"whitespace_flexible": params.disable_any_whitespace is False}
    try:
        if params.json is not None:
            schema = params.json if params.disable_additional_properties is False \
                else strict_schema(params.json)
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        if params.json_object:
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                                 overrides=options)
        if params.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(params.regex)
        if params.choice is not None:
            return llguidance.grammar_from("choice", json.dumps(params.choice))
        assert params.grammar is not None
        return llguidance.grammar_from("grammar", params.grammar)
    except (ValueError, TypeError) as e:
        raise ValidationError(f"invalid {params.kinds()[0]}: {e}", "structured_outputs") from None


def check_grammar(params: StructuredOutputsParams) -> str:
    """The grammar for `params`, after llguidance accepted it.

    Raises ValidationError naming the problem (llguidance's message) for an unsupported
    JSON schema, a bad regex or a grammar that does not parse."""
    grammar = grammar_for(params)
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValidationError(f"invalid {params.kinds()[0]}: {error.strip()}",
                              "structured_outputs")
    return grammar
