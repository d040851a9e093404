"""No grammar can hurt the server: each structured-output body that once killed it (a stack
overflow inside llguidance) or held it for tens of seconds is answered at once, through
every field that carries a grammar; /health answers meanwhile, and afterwards a greedy
request returns the same text as before."""

import json
import threading
import time

import httpx
import pytest

GREEDY = {"prompt": "The three primary colors are", "max_tokens": 12, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}


def lark_chain(n):
    return "\n".join(["start: r0"] + [f'r{i}: "a{i}" r{i + 1} | "b"' for i in range(n)]
                     + [f'r{n}: "z"'])


def gbnf_chain(n):
    return "\n".join(["root ::= r0"] + [f'r{i} ::= "a" r{i + 1} | "b"' for i in range(n)]
                     + [f'r{n} ::= "z"'])


def ref_chain(n):
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}}
            for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def doubling(n):
    defs = {f"d{i}": {"allOf": [{"$ref": f"#/$defs/d{i + 1}"}, {"$ref": f"#/$defs/d{i + 1}"}]}
            for i in range(n)}
    defs[f"d{n}"] = {"type": "object", "properties": {"a": {"type": "integer"}},
                     "required": ["a"]}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def tools_body(schema):
    return {**CHAT, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": schema}}]}


def response_format(schema):
    return {**CHAT, "response_format": {"type": "json_schema",
                                        "json_schema": {"name": "s", "schema": schema}}}


@pytest.fixture(scope="module")
def greedy_before(server, auth):
    """The greedy text, taken after a first structured request (which loads the core's
    grammar tokenizer, a one-time cost the timings below should not include)."""
    warm = {"prompt": "x", "max_tokens": 1, "response_format": {"type": "json_object"}}
    for body in (warm, GREEDY):
        r = httpx.post(server.url + "/v1/completions", json=body, headers=auth, timeout=120)
        assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def post_watching_health(server, auth, path, body):
    """(response, seconds it took, slowest /health answer while it was in flight)."""
    result = {}

    def send():
        start = time.monotonic()
        result["r"] = httpx.post(server.url + path, json=body, headers=auth, timeout=120)
        result["seconds"] = time.monotonic() - start

    sender = threading.Thread(target=send)
    sender.start()
    slowest = 0.0
    with httpx.Client(base_url=server.url, timeout=10) as probe:
        while True:
            start = time.monotonic()
            assert probe.get("/health").status_code == 200
            slowest = max(slowest, time.monotonic() - start)
            if not sender.is_alive():
                break
    sender.join()
    return result["r"], result["seconds"], slowest


def assert_engine_unhurt(server, auth, greedy_before):
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    r = httpx.post(server.url + "/v1/completions", json=GREEDY, headers=auth, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy_before, r.text


CRASHES = [   # (path, body, the field named in the 400, the limit named)
    ("/v1/completions", {"prompt": "x", "guided_grammar": lark_chain(3000)}, "guided_grammar",
     "MAX_RULE_DEPTH"),
    ("/v1/completions", {"prompt": "x", "guided_grammar": gbnf_chain(10_000)},
     "guided_grammar", "MAX_GRAMMAR_CHARS"),
    ("/v1/completions", {"prompt": "x", "guided_grammar": gbnf_chain(2000)},
     "guided_grammar", "MAX_RULE_DEPTH"),
    ("/v1/completions", {"prompt": "x", "guided_grammar": "start: %json "
                         + json.dumps(ref_chain(1000))}, "guided_grammar", "MAX_SCHEMA_DEPTH"),
    ("/v1/chat/completions", response_format(ref_chain(1000)), "response_format",
     "MAX_SCHEMA_DEPTH"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"json": ref_chain(12_000)}},
     "structured_outputs", "MAX_SCHEMA_VALUES"),
    ("/v1/chat/completions", tools_body(ref_chain(1000)), "tools", "MAX_SCHEMA_DEPTH"),
]


def test_crash_grammars_are_refused_naming_the_limit(server, auth, greedy_before):
    for path, body, param, limit in CRASHES:
        r, seconds, slowest_health = post_watching_health(server, auth, path, body)
        assert r.status_code == 400, (param, r.text[:300])
        error = r.json()["error"]
        assert error["param"] == param and limit in error["message"], error
        assert slowest_health < 0.5, (param, slowest_health)
        print(f"{param} ({limit}): {seconds * 1000:.0f} ms, slowest /health "
              f"{slowest_health * 1000:.0f} ms")
    assert_engine_unhurt(server, auth, greedy_before)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "{", "max_tokens": 1, "guided_json": doubling(18)}),
    ("/v1/chat/completions", {**response_format(doubling(30)), "max_tokens": 1}),
    ("/v1/chat/completions", {**tools_body(doubling(30)), "max_tokens": 1}),
], ids=["guided_json 18", "response_format 30", "tools 30"])
def test_doubling_refs_are_answered_at_once(server, auth, greedy_before, path, body):
    """A schema whose strict rewrite once took 2^levels copies (36-48 s and gigabytes at 18
    levels) is rewritten in linear time and served. The fastest of up to three tries counts:
    on a busy machine any request can take a second or two, the old rewrite took 36 s each."""
    tries = []
    while len(tries) < 3 and (not tries or tries[-1][1] >= 2.0):
        tries.append(post_watching_health(server, auth, path, body))
    for r, seconds, slowest_health in tries:
        assert r.status_code in (200, 400), r.text[:300]
        assert slowest_health < 0.5, slowest_health
    fastest = min(seconds for _, seconds, _ in tries)
    print(f"{path}: {tries[-1][0].status_code} in {fastest * 1000:.0f} ms ({len(tries)} tries)")
    assert fastest < 2.0, [seconds for _, seconds, _ in tries]
    assert_engine_unhurt(server, auth, greedy_before)
