"""/v1/completions choices with exact values: echo of the prompt's text and logprobs, vLLM's
top_logprobs (chosen + k best) and -9999 floor, text offsets, streamed pieces that add up to
the whole choice, echo without generation, and the SamplingParams echo asks for."""

import math

import pytest

from vllm_actors.frontend.completion_choices import ChoiceShaper, completion_logprobs
from vllm_actors.frontend.openai_schema import (
    APIError,
    CompletionRequest,
    sampling_params,
)
from vllm_actors.outputs import CompletionOutput, Logprob

TEXT = {10: "a", 11: "bb", 12: "c", 13: "q", 20: "X", 21: "Y", 22: "Z"}
PROMPT_IDS = [10, 11, 12]
PROMPT_TEXT = "abbc"
PROMPT_LPS = [None,
              {11: Logprob(-1.0, 2, "bb"), 13: Logprob(-0.5, 1, "q")},
              {12: Logprob(-0.25, 1, "c")}]
GENERATED_LPS = [{20: Logprob(-0.1, 1, "X"), 22: Logprob(-3.0, 2, "Z")},
                 {21: Logprob(-math.inf, 5, "Y"), 20: Logprob(-0.2, 1, "X"),
                  22: Logprob(-1.9, 2, "Z")}]

ECHOED = {"tokens": ["a", "bb", "c", "X", "Y"],
          "token_logprobs": [None, -1.0, -0.25, -0.1, -9999.0],
          "top_logprobs": [None, {"bb": -1.0, "q": -0.5}, {"c": -0.25}, {"X": -0.1, "Z": -3.0},
                           {"Y": -9999.0, "X": -0.2}],
          "text_offset": [0, 1, 3, 4, 5]}


def shaper(echo=True, echo_only=False, k=1, texts=(PROMPT_TEXT,)):
    return ChoiceShaper(list(texts), echo, echo_only, k, TEXT.__getitem__)


def whole(finish="length"):
    return CompletionOutput(0, "XY", [20, 21], finish, None, list(GENERATED_LPS))


def deltas(index=0):
    return [CompletionOutput(index, "X", [20], None, None, GENERATED_LPS[:1]),
            CompletionOutput(index, "Y", [21], "length", None, GENERATED_LPS[1:])]


def concat(pieces):
    lists = {key: [] for key in ECHOED}
    for piece in pieces:
        for key in lists:
            lists[key] += piece.logprobs[key]
    return "".join(p.text for p in pieces), lists


def test_logprobs_lists_keep_chosen_plus_k_best_and_floor_minus_inf():
    lists, end = completion_logprobs([20, 21], GENERATED_LPS, 0, TEXT.__getitem__, 7)
    assert lists == {"tokens": ["X", "Y"], "token_logprobs": [-0.1, -9999.0],
                     "top_logprobs": [{"X": -0.1}, {"Y": -9999.0}], "text_offset": [7, 8]}
    assert end == 9
    lists, _ = completion_logprobs([20, 21], GENERATED_LPS, 2, TEXT.__getitem__)
    assert lists["top_logprobs"][1] == {"Y": -9999.0, "X": -0.2, "Z": -1.9}


def test_echo_puts_prompt_entries_first():
    piece = shaper().piece(0, 0, PROMPT_IDS, PROMPT_LPS, whole())
    assert piece.text == "abbcXY" and piece.num_generated == 2
    assert piece.logprobs == ECHOED


def test_without_echo_only_generated_tokens():
    piece = shaper(echo=False).piece(0, 0, PROMPT_IDS, PROMPT_LPS, whole())
    assert piece.text == "XY"
    assert piece.logprobs == {key: value[3:] for key, value in ECHOED.items()} | \
        {"text_offset": [0, 1]}


def test_streamed_pieces_concatenate_to_the_whole_choice():
    s = shaper()
    first, second = deltas()
    pieces = [s.piece(0, 0, PROMPT_IDS, PROMPT_LPS, first),
              s.piece(0, 0, PROMPT_IDS, None, second)]
    assert [p.text for p in pieces] == ["abbcX", "Y"]
    assert concat(pieces) == ("abbcXY", ECHOED)
    assert [p.num_generated for p in pieces] == [1, 1]


def test_every_choice_of_a_prompt_echoes_it_once():
    """A stream carries prompt logprobs once per prompt; the second choice still gets them."""
    s = shaper()
    a, b = deltas(0), deltas(1)
    order = [(0, a[0], PROMPT_LPS), (1, b[0], None), (1, b[1], None), (0, a[1], None)]
    pieces = {0: [], 1: []}
    for index, delta, prompt_lps in order:
        pieces[index].append(s.piece(0, index, PROMPT_IDS, prompt_lps, delta))
    assert concat(pieces[0]) == concat(pieces[1]) == ("abbcXY", ECHOED)


def test_echo_without_generation_returns_the_prompt_alone():
    for s, outputs in ((shaper(echo_only=True), [whole("stop")]),
                       (shaper(echo_only=True), deltas())):
        pieces = [s.piece(0, 0, PROMPT_IDS, PROMPT_LPS, out) for out in outputs]
        assert concat(pieces) == (PROMPT_TEXT, {k: v[:3] for k, v in ECHOED.items()})
        assert sum(p.num_generated for p in pieces) == 0
    no_logprobs = shaper(echo_only=True, k=None).piece(0, 0, PROMPT_IDS, None, whole())
    assert (no_logprobs.text, no_logprobs.logprobs) == (PROMPT_TEXT, None)


def test_missing_prompt_logprobs_is_an_internal_error():
    with pytest.raises(AssertionError, match="no prompt logprobs"):
        shaper().piece(0, 0, PROMPT_IDS, None, whole())


def test_echo_sets_prompt_logprobs_and_max_tokens_as_vllm():
    def params(**fields):
        return sampling_params(CompletionRequest(prompt="x", **fields),
                               fields.get("max_tokens", 16), {}, False)

    echo_only = params(echo=True, logprobs=1, max_tokens=0)
    assert (echo_only.max_tokens, echo_only.prompt_logprobs, echo_only.logprobs) == (1, 1, 1)
    assert params(echo=True, logprobs=2, prompt_logprobs=4).prompt_logprobs == 4
    assert params(echo=True).prompt_logprobs is None
    assert params(logprobs=2).prompt_logprobs is None
    with pytest.raises(APIError) as refused:
        params(max_tokens=0, logprobs=1)
    assert (refused.value.status, refused.value.param) == (400, "max_tokens")
    assert "only allowed with echo=true" in refused.value.message
