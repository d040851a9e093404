"""echo and logprobs on /v1/completions as vLLM returns them, over HTTP to the real server:
lm-evaluation-harness's loglikelihood requests scored against the engine's prompt logprobs,
echoed text and offsets streamed and not, echo with n > 1 and several prompts."""

import json

import httpx
import pytest

from vllm_actors import SamplingParams

CONTEXT = "Question: What is the capital of France?\nAnswer: The capital of France is"
# Continuations as token ids; the last is " Paris" split as " Par" + "is", which decoding and
# re-encoding would turn into the single token " Paris": exact ids must survive the trip.
CHOICES = {" Paris": [7042], " London": [4528], " Berlin": [11452], " a banana": [253, 21285],
           " Par|is": [2860, 271]}
PROMPT = "The capital of France is"


def post(server, auth, body):
    r = httpx.post(server.url + "/v1/completions", json=body, headers=auth, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def stream(server, auth, body):
    """The stream's chunks (without [DONE]), after checking it ended with [DONE]."""
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True},
                      headers=auth, timeout=120) as r:
        assert r.status_code == 200, r.read()
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def joined(chunks):
    """Per choice index: streamed text and the four logprobs lists, concatenated."""
    out = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            text, lists = out.setdefault(choice["index"], ["", None])
            out[choice["index"]][0] = text + choice["text"]
            if choice["logprobs"] is not None:
                lists = lists or {key: [] for key in choice["logprobs"]}
                for key, values in choice["logprobs"].items():
                    lists[key] += values
                out[choice["index"]][1] = lists
    return out


# Logprobs of the same tokens computed in batches of different shapes (a stream's sub-requests
# and a whole request's are scheduled differently) differ in float32's last bits; 1.07e-5 was
# seen on a logprob of -2.44. Tokens, offsets and texts are compared exactly.
FLOAT32_BATCH_NOISE = 1e-4


def assert_same_lists(a, b):
    def close(x, y):
        return x == pytest.approx(y, abs=FLOAT32_BATCH_NOISE)

    assert a["tokens"] == b["tokens"] and a["text_offset"] == b["text_offset"]
    assert [x is None for x in a["token_logprobs"]] == [x is None for x in b["token_logprobs"]]
    assert close([x for x in a["token_logprobs"] if x is not None],
                 [x for x in b["token_logprobs"] if x is not None])
    for x, y in zip(a["top_logprobs"], b["top_logprobs"], strict=True):
        assert (x is None) == (y is None)
        if x is not None:
            assert sorted(x) == sorted(y) and close([x[t] for t in x], [y[t] for t in x])


@pytest.fixture(scope="module")
def context_ids(smollm2_tokenizer):
    return smollm2_tokenizer.encode(CONTEXT)


def lm_eval_scores(choices, ctxlen, max_tokens):
    """lm-evaluation-harness's local-completions parse_logprobs: (sum, is_greedy) per choice,
    over token_logprobs[ctxlen:-1] (the last entry is the generated token); with max_tokens
    0 nothing is generated, so the slice runs to the end."""
    end = -1 if max_tokens else None
    scores = []
    for choice in sorted(choices, key=lambda c: c["index"]):
        values = choice["logprobs"]["token_logprobs"][ctxlen:end]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:end]
        scores.append((sum(values), all(v == max(t.values()) for v, t in zip(values, tops))))
    return scores


def test_lm_eval_loglikelihood_matches_engine_prompt_logprobs(server, auth, smollm2_llm,
                                                              smollm2_tokenizer, context_ids):
    ctxlen = len(context_ids)
    prompts = [context_ids + ids for ids in CHOICES.values()]
    oracle = smollm2_llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    expected = [sum(out.prompt_logprobs[i][p[i]].logprob for i in range(ctxlen, len(p)))
                for out, p in zip(oracle, prompts)]
    greedy = [all(out.prompt_logprobs[i][p[i]].rank == 1 for i in range(ctxlen, len(p)))
              for out, p in zip(oracle, prompts)]
    ranking = sorted(range(len(prompts)), key=lambda i: -expected[i])
    assert list(CHOICES)[ranking[0]] == " Paris"
    assert greedy[0] and not all(greedy), "the item should exercise both greedy outcomes"

    for max_tokens in (0, 1):
        body = post(server, auth, {"model": "smol", "prompt": prompts, "temperature": 0,
                                   "max_tokens": max_tokens, "logprobs": 1, "seed": 1234,
                                   "echo": True})
        choices = body["choices"]
        assert [c["index"] for c in choices] == list(range(len(prompts)))
        assert body["usage"]["prompt_tokens"] == sum(map(len, prompts))
        assert body["usage"]["completion_tokens"] == max_tokens * len(prompts)
        for choice, p in zip(choices, prompts):
            lp = choice["logprobs"]
            assert len(lp["tokens"]) == len(p) + max_tokens
            assert lp["tokens"][:len(p)] == [smollm2_tokenizer.decode([t]) for t in p]
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            assert choice["text"].startswith(smollm2_tokenizer.decode(p))
            assert choice["finish_reason"] in ("length", "stop")
        scores = lm_eval_scores(choices, ctxlen, max_tokens)
        assert [s for s, _ in scores] == pytest.approx(expected, abs=FLOAT32_BATCH_NOISE)
        assert sorted(range(len(prompts)), key=lambda i: -scores[i][0]) == ranking
        assert [g for _, g in scores] == greedy


def test_echo_text_and_offsets_streamed_and_not(server, auth, smollm2_tokenizer):
    body = {"model": "smol", "prompt": PROMPT, "temperature": 0, "max_tokens": 6,
            "logprobs": 2, "echo": True, "ignore_eos": True}
    (choice,) = post(server, auth, body)["choices"]
    lp, text = choice["logprobs"], choice["text"]
    prompt_ids = smollm2_tokenizer.encode(PROMPT)
    assert text.startswith(PROMPT) and len(lp["tokens"]) == len(prompt_ids) + 6
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert "".join(lp["tokens"]) == text
    for token, offset in zip(lp["tokens"], lp["text_offset"]):
        assert text[offset:offset + len(token)] == token
    for token, value, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:],
                                 lp["top_logprobs"][1:]):
        assert top[token] == value and len(top) in (2, 3) and value <= 0
    assert choice["prompt_logprobs"][0] is None and len(choice["prompt_logprobs"]) == \
        len(prompt_ids)

    chunks = stream(server, auth, body)
    first = chunks[0]["choices"][0]
    assert first["text"].startswith(PROMPT)
    assert first["logprobs"]["tokens"][:len(prompt_ids)] == lp["tokens"][:len(prompt_ids)]
    ((streamed_text, streamed_lists),) = joined(chunks).values()
    assert streamed_text == text
    assert_same_lists(streamed_lists, lp)


def test_echo_without_generation(server, auth, smollm2_tokenizer):
    prompt_ids = smollm2_tokenizer.encode(PROMPT)
    body = {"model": "smol", "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1}
    whole = post(server, auth, body)
    (choice,) = whole["choices"]
    assert choice["text"] == PROMPT and choice["finish_reason"] in ("length", "stop")
    assert choice["logprobs"]["tokens"] == [smollm2_tokenizer.decode([t]) for t in prompt_ids]
    assert whole["usage"]["prompt_tokens"] == len(prompt_ids)
    assert whole["usage"]["completion_tokens"] == 0

    chunks = stream(server, auth, {**body, "stream_options": {"include_usage": True}})
    assert chunks[-1]["usage"]["completion_tokens"] == 0 and chunks[-1]["choices"] == []
    ((text, lists),) = joined(chunks[:-1]).values()
    assert text == PROMPT and chunks[-2]["choices"][0]["finish_reason"] in ("length", "stop")
    assert_same_lists(lists, choice["logprobs"])

    # a one-token prompt has no position to score: its lists are [None], beside a longer one
    lone = {"model": "smol", "prompt": [prompt_ids, prompt_ids[:1]], "max_tokens": 0,
            "echo": True, "logprobs": 1}
    for lists in (post(server, auth, lone)["choices"][1]["logprobs"],
                  joined(stream(server, auth, lone))[1][1]):
        assert lists["tokens"] == [smollm2_tokenizer.decode(prompt_ids[:1])]
        assert lists["token_logprobs"] == [None] and lists["top_logprobs"] == [None]

    plain = post(server, auth, {"model": "smol", "prompt": PROMPT, "max_tokens": 0,
                                "echo": True})
    assert plain["choices"][0]["text"] == PROMPT and plain["choices"][0]["logprobs"] is None
    refused = httpx.post(server.url + "/v1/completions", headers=auth, timeout=60,
                         json={"model": "smol", "prompt": PROMPT, "max_tokens": 0})
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["param"] == "max_tokens" and "only allowed with echo=true" in error["message"]


def test_echo_with_n_and_several_prompts(server, auth, smollm2_tokenizer):
    prompts = [PROMPT, "1, 2, 3,"]
    body = {"model": "smol", "prompt": prompts, "n": 2, "temperature": 0, "max_tokens": 3,
            "ignore_eos": True, "logprobs": 1, "echo": True}
    whole = post(server, auth, body)
    choices = whole["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    lengths = [len(smollm2_tokenizer.encode(p)) for p in prompts]
    assert (whole["usage"]["prompt_tokens"], whole["usage"]["completion_tokens"]) == \
        (sum(lengths), 12)
    for choice in choices:
        p = choice["index"] // 2
        assert choice["text"].startswith(prompts[p])
        assert len(choice["logprobs"]["tokens"]) == lengths[p] + 3
        assert choice["logprobs"]["token_logprobs"][0] is None
    for a, b in ((0, 1), (2, 3)):   # greedy: both completions of a prompt agree
        assert choices[a]["text"] == choices[b]["text"]
        assert_same_lists(choices[a]["logprobs"], choices[b]["logprobs"])

    streamed = joined(stream(server, auth, body))
    assert sorted(streamed) == [0, 1, 2, 3]
    for choice in choices:
        text, lists = streamed[choice["index"]]
        assert text == choice["text"]
        assert_same_lists(lists, choice["logprobs"])
