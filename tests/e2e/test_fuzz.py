"""Property: no request body and no SamplingParams can hurt the engine. Random and extreme
values for every sampling field go to the shared server and to one `LLM`; each is either
served or refused with a typed error (HTTP 400 naming a field / ValidationError), never a
500, a 503, a hang or a dead engine, and afterwards a greedy request returns exactly the
tokens it returned before."""

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from vllm_actors import SamplingParams
from vllm_actors.errors import ValidationError

EDGE_INTS = [0, 1, -1, 2, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63),
             -(2**63) - 1, 10**30, 49151, 49152]
EDGE_FLOATS = [0.0, -0.0, 1e-300, 1e-45, 1e-5, 0.01, 0.5, 1.0, 2.0, -2.0, 100.0, 3.4e38,
               1e39, -1e39, 1.7e308]
VALUES = st.one_of(
    st.none(), st.booleans(), st.sampled_from(EDGE_INTS), st.integers(-3, 60),
    st.sampled_from(EDGE_FLOATS), st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12), st.lists(st.sampled_from(EDGE_INTS + [5, 17]), max_size=4),
    st.lists(st.text(min_size=0, max_size=6), max_size=3),
    st.dictionaries(st.sampled_from(["5", "17", "-1", "99999", "x"]),
                    st.sampled_from(EDGE_FLOATS + [5]), max_size=3))
INTS = st.one_of(st.sampled_from(EDGE_INTS), st.integers(-2, 6))
FLOATS = st.one_of(st.sampled_from(EDGE_FLOATS), st.floats(0, 2))
IDS = st.lists(st.sampled_from([0, 1, 2, 5, 17, 49151, 49152, -1, 2**64]), max_size=4)
WORDS = st.lists(st.sampled_from(["", "a", "Hello", " the", "\n", "\u00e9t\u00e9", "x" * 50]),
                 max_size=3)
TYPED = {  # each field's own type, at and beyond the edges of its range
    **dict.fromkeys(["n", "top_k", "seed", "min_tokens", "prompt_logprobs", "logprobs",
                     "best_of", "priority"], INTS),
    **dict.fromkeys(["temperature", "top_p", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"], FLOATS),
    **dict.fromkeys(["ignore_eos", "skip_special_tokens", "include_stop_str_in_output",
                     "spaces_between_special_tokens"], st.booleans()),
    **dict.fromkeys(["allowed_token_ids", "stop_token_ids"], IDS),
    **dict.fromkeys(["bad_words", "stop"], WORDS),
    "logit_bias": st.dictionaries(st.sampled_from(["5", "17", "-1", "49152", "x"]), FLOATS,
                                  max_size=3),
}
FIELDS = sorted(TYPED)
HTTP_ONLY = {"echo": st.booleans(), "stream": st.booleans(), "user": VALUES,
             "guided_choice": st.lists(st.text(max_size=4), max_size=3),
             "response_format": st.sampled_from([{"type": "json_object"}, {"type": "x"}, {}])}


@st.composite
def fields(draw, names: list[str], extra: dict | None = None) -> dict:
    """A few fields, each mostly of its own type (sometimes anything), plus max_tokens."""
    strategies = {**{n: TYPED[n] for n in names}, **(extra or {})}
    chosen = draw(st.lists(st.sampled_from(sorted(strategies)), max_size=5, unique=True))
    out = {"max_tokens": draw(st.sampled_from([1, 2, 4, 0, -1, 2**64]) if extra
                              else st.sampled_from([1, 3]))}
    for name in chosen:
        wild = draw(st.integers(0, 5)) == 0
        out[name] = draw(VALUES if wild else strategies[name])
    return out


BODIES = fields(FIELDS, HTTP_ONLY)
GREEDY = {"prompt": "The capital of France is", "max_tokens": 10, "temperature": 0}


@pytest.fixture(scope="module")
def greedy_text(server, auth):
    return httpx.post(server.url + "/v1/completions", json=GREEDY, headers=auth,
                      timeout=60).json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def http(server, auth):
    with httpx.Client(base_url=server.url, headers=auth, timeout=120) as client:
        yield client


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=BODIES, chat=st.booleans())
def test_random_bodies_are_served_or_refused(http, greedy_text, body, chat):
    if chat:
        body = {**body, "messages": [{"role": "user", "content": "Hi"}]}
        body.pop("echo", None)
    else:
        body = {**body, "prompt": "Hello there"}
    r = http.post("/v1/chat/completions" if chat else "/v1/completions", json=body)
    assert r.status_code in (200, 400), (body, r.status_code, r.text[:500])
    event(f"HTTP {r.status_code}")
    if r.status_code == 400:
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"], error
    elif body.get("stream"):
        assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text, r.text


def test_server_after_the_fuzz(http, greedy_text):
    assert http.get("/health").status_code == 200
    r = http.post("/v1/completions", json=GREEDY)
    assert r.json()["choices"][0]["text"] == greedy_text


PARAMS = fields([f for f in FIELDS if f != "priority"])


@pytest.fixture(scope="module")
def llm_greedy(smollm2_llm):
    params = SamplingParams(temperature=0, max_tokens=10)
    return smollm2_llm.generate("The capital of France is", params)[0].outputs[0].token_ids


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(kwargs=PARAMS)
def test_random_sampling_params(smollm2_llm, llm_greedy, kwargs):
    try:
        params = SamplingParams(**kwargs)
    except ValidationError as e:
        assert e.param in kwargs or e.param in ("min_tokens", "best_of"), (kwargs, e)
        event("refused by SamplingParams")
        return
    try:
        (out,) = smollm2_llm.generate("Hello there", params, use_tqdm=False)
    except ValidationError:
        event("refused by the input processor")
        return
    event(f"served: {sorted({c.finish_reason for c in out.outputs})}")
    assert out.finished and len(out.outputs) == params.n
    for c in out.outputs:
        assert c.finish_reason in ("stop", "length", "error"), c
        assert c.finish_reason != "error" or out.error_param is not None, out.error


def test_llm_after_the_fuzz(smollm2_llm, llm_greedy):
    params = SamplingParams(temperature=0, max_tokens=10)
    assert smollm2_llm.generate("The capital of France is",
                                params)[0].outputs[0].token_ids == llm_greedy
