"""StructuredOutputsParams checks, grammar validation messages, and the bitmask the worker
applies to logits."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_actors.errors import ValidationError
from vllm_actors.grammar import check_grammar
from vllm_actors.sampling_params import SamplingParams, StructuredOutputsParams
from vllm_actors.workers.sampler import apply_token_bitmask


@pytest.mark.parametrize("kw, pattern", [
    ({}, "exactly one of .* got none"),
    ({"regex": "a", "choice": ["b"]}, "got regex, choice"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": "[1, 2]"}, "must be a JSON object"),
    ({"choice": []}, "non-empty list"),
    ({"choice": ["a", ""]}, "non-empty strings"),
])
def test_params_refused(kw, pattern):
    with pytest.raises(ValidationError, match=pattern):
        StructuredOutputsParams(**kw)


def test_json_text_is_read_and_params_travel_in_sampling_params():
    params = StructuredOutputsParams(json='{"type": "object"}')
    assert params.json == {"type": "object"} and params.kinds() == ["json"]
    sp = SamplingParams(structured_outputs=params)
    assert sp.structured_outputs.json == {"type": "object"}


@pytest.mark.parametrize("kw, pattern", [
    ({"regex": "a(b"}, "(?s)invalid regex: .*unclosed group"),
    ({"grammar": "root ::= undefined_rule"}, "(?s)invalid grammar: .*undefined_rule"),
    ({"json": {"type": "integer", "minimum": "x"}}, "invalid json"),
    ({"json": {"type": "wat"}}, "invalid json"),
])
def test_grammar_errors_name_the_problem(kw, pattern):
    with pytest.raises(ValidationError, match=pattern) as info:
        check_grammar(StructuredOutputsParams(**kw))
    assert info.value.param == "structured_outputs"


@pytest.mark.parametrize("kw", [{"regex": r"\d+"}, {"choice": ["a", "b"]},
                                {"grammar": 'root ::= "x" | "y"'}, {"grammar": 'start: "x"'},
                                {"json_object": True},
                                {"json": {"type": "array", "items": {"type": "boolean"}}}])
def test_good_grammars_pass(kw):
    assert check_grammar(StructuredOutputsParams(**kw))


def test_bitmask_masks_exactly_the_cleared_bits():
    rng = np.random.default_rng(0)
    vocab, rows = 100, np.array([0, 2])          # 100 tokens: 4 words, the last one partial
    logits = rng.standard_normal((3, vocab)).astype(np.float32)
    before = logits.copy()
    bitmask = rng.integers(-2**31, 2**31, size=(2, 4), dtype=np.int64).astype(np.int32)
    bitmask[1] = 0
    bitmask[1, 1] = 1 << 5                       # only token 37 allowed in the second row
    empty = apply_token_bitmask(logits, rows, bitmask)
    assert empty.tolist() == []
    for i, row in enumerate(rows):
        allowed = [(int(bitmask[i, t // 32]) >> (t % 32)) & 1 == 1 for t in range(vocab)]
        expect = np.where(allowed, before[row], -np.inf)
        np.testing.assert_array_equal(logits[row], expect)
    np.testing.assert_array_equal(logits[1], before[1])   # rows not named are untouched
    assert np.isfinite(logits[2]).sum() == 1 and np.isfinite(logits[2, 37])


def test_bitmask_reports_rows_with_nothing_allowed():
    logits = np.zeros((2, 40), np.float32)
    bitmask = np.array([[0, 0], [1, 0]], np.int32)
    assert apply_token_bitmask(logits, np.array([0, 1]), bitmask).tolist() == [0]
