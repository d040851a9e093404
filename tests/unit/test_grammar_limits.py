"""Grammar limits: each input that once crashed the process inside llguidance (a stack
overflow in native code) is refused by a measured limit before llguidance sees it, in
milliseconds; real grammars and schemas (recursive ones, hundreds of rules or `$defs`) still
compile; llguidance runs on big-stack threads whichever thread asks."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from grammar_text import BYTES, params_accept

from vllm_actors import grammar, grammar_limits
from vllm_actors.errors import ValidationError
from vllm_actors.grammar import check_grammar, compile_matcher
from vllm_actors.sampling_params import StructuredOutputsParams
from vllm_actors.strict_schema import strict_schema


def lark_chain(n: int) -> str:
    return "\n".join(["start: r0"] + [f'r{i}: "a{i}" r{i + 1} | "b"' for i in range(n)]
                     + [f'r{n}: "z"'])


def gbnf_chain(n: int) -> str:
    return "\n".join(["root ::= r0"] + [f'r{i} ::= "a" r{i + 1} | "b"' for i in range(n)]
                     + [f'r{n} ::= "z"'])


def ref_chain(n: int) -> dict:
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}}
            for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def doubling(n: int) -> dict:
    """Each definition is both pieces of the next: inlining every use is 2^n copies."""
    defs = {f"d{i}": {"allOf": [{"$ref": f"#/$defs/d{i + 1}"}, {"$ref": f"#/$defs/d{i + 1}"}]}
            for i in range(n)}
    defs[f"d{n}"] = {"type": "object", "properties": {"a": {"type": "integer"}}}
    return {"$ref": "#/$defs/d0", "$defs": defs}


CRASHES = {   # each killed the server (SIGSEGV) before the limits; name -> (params, limit)
    "lark chain 3,000": ({"grammar": lark_chain(3000)}, "MAX_RULE_DEPTH = 1,000"),
    "gbnf chain 10,000": ({"grammar": gbnf_chain(10_000)}, "MAX_GRAMMAR_CHARS = 131,072"),
    "gbnf chain 2,000 (under the size limit)": ({"grammar": gbnf_chain(2000)},
                                                "MAX_RULE_DEPTH = 1,000"),
    "gbnf chain 400 (slow to convert)": ({"grammar": gbnf_chain(400)},
                                         "MAX_GBNF_WORK = 250,000"),
    "$ref chain 1,000": ({"json": ref_chain(1000)}, "MAX_SCHEMA_DEPTH = 512"),
    "$ref chain 12,000": ({"json": ref_chain(12_000)}, "MAX_SCHEMA_VALUES = 50,000"),
    "$ref chain 8,000": ({"json": ref_chain(8000)}, "MAX_SCHEMA_DEPTH = 512"),
    "%json $ref chain in lark": ({"grammar": "start: %json " + json.dumps(ref_chain(1000))},
                                 "MAX_SCHEMA_DEPTH = 512"),
    "lark chain in parentheses": ({"grammar": "\n".join(
        ["start: r0"] + [f'r{i}: "a" ' + "(" * 28 + f'"c" r{i + 1}' + ")" * 28
                         for i in range(200)] + ['r200: "z"'])}, "MAX_RULE_DEPTH = 1,000"),
}


# A refusal takes 2-80 ms here; what the limits cut short took 36-48 s (the doubling graph)
# or walked llguidance's native stack to a crash. The timed checks bound it at 1 s with the
# session's heap frozen: this late in a run the process holds ~2 GB, and the 8,000-deep $ref
# chain once took 0.6 s there (a shared machine, a profiler attached; a full collection over
# the session's objects, which a schema of 8,000 dicts can trigger, is the likely cause).
TIME_BOUND_S = 1.0


@pytest.fixture
def heap_frozen():
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.mark.parametrize("name", list(CRASHES))
def test_crash_inputs_are_refused_by_a_named_limit(name, heap_frozen):
    kwargs, limit = CRASHES[name]
    params = StructuredOutputsParams(**kwargs)
    start = time.perf_counter()
    with pytest.raises(ValidationError, match=limit) as info:
        check_grammar(params)
    assert time.perf_counter() - start < TIME_BOUND_S
    assert info.value.param == "structured_outputs"
    with pytest.raises(ValidationError, match=limit):   # the core's compile: the same limits
        compile_matcher(BYTES, params)


@pytest.mark.parametrize("levels", [18, 30])
def test_doubling_refs_are_answered_at_once(levels, heap_frozen):
    start = time.perf_counter()
    params = StructuredOutputsParams(json=doubling(levels))
    assert params_accept(params, '{"a":1}') and not params_accept(params, '{"a":1,"b":2}')
    assert time.perf_counter() - start < TIME_BOUND_S


def test_strict_rewrite_is_linear_in_the_schema():
    """The doubling graph's rewrite grows by the same amount per level (it was 2^levels)."""
    sizes = [grammar_limits.count_values(strict_schema(doubling(n)), 10**6)
             for n in (10, 20, 30)]
    assert sizes[2] - sizes[1] == sizes[1] - sizes[0] < 300


def test_a_shared_ref_is_opened_once_and_keeps_its_meaning():
    base = {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}
    schema = {"$defs": {"Base": base}, "type": "object", "required": ["a", "b"], "properties": {
        "a": {"allOf": [{"$ref": "#/$defs/Base"}, {"properties": {"s": {"type": "string"}}}]},
        "b": {"$ref": "#/$defs/Base", "properties": {"n": {"type": "integer"}}}}}
    out = strict_schema(schema)
    assert out["$defs"]["Base.open"] == base   # one open copy, referred to by both uses
    assert json.dumps(out).count('"#/$defs/Base.open"') == 2
    params = StructuredOutputsParams(json=schema)
    assert params_accept(params, '{"a":{"id":1,"s":"x"},"b":{"id":2,"n":3}}')
    for bad in ('{"a":{"id":1,"n":3},"b":{"id":2}}', '{"a":{"id":1},"b":{"id":2,"s":"x"}}',
                '{"a":{"s":"x"},"b":{"id":2}}'):
        assert not params_accept(params, bad), bad


def test_a_rewrite_beyond_the_value_limit_is_refused(heap_frozen):
    """Closing 200 objects over the 600 names of one shared piece adds 120,000 values."""
    big = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(600)}}
    schema = {"$defs": {"Big": big}, "type": "object", "properties": {
        f"o{i}": {"allOf": [{"$ref": "#/$defs/Big"}, {"required": [f"q{i}"]}]}
        for i in range(200)}}
    start = time.perf_counter()
    with pytest.raises(ValidationError, match="MAX_SCHEMA_VALUES = 50,000"):
        check_grammar(StructuredOutputsParams(json=schema))
    assert time.perf_counter() - start < TIME_BOUND_S


def test_recursive_and_large_real_grammars_still_compile():
    tree = {"$defs": {"Node": {"type": "object", "required": ["v"], "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/Node"}}}}},
        "$ref": "#/$defs/Node"}
    assert params_accept(StructuredOutputsParams(json=tree), '{"v":1,"kids":[{"v":2,"kids":[]}]}')
    base = {"type": "object", "required": ["id"], "properties": {"id": {"type": "integer"}}}
    defs = {f"T{i}": {"allOf": [{"$ref": "#/$defs/Base"}], "type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20},
        "parent": {"anyOf": [{"$ref": f"#/$defs/T{i // 2}"}, {"type": "null"}]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}}} for i in range(300)}
    wide = {"$defs": {"Base": base, **defs}, "type": "object", "properties": {
        f"f{i}": {"$ref": f"#/$defs/T{i}"} for i in range(0, 300, 7)}}
    params = StructuredOutputsParams(json=wide)
    assert params_accept(params, '{"f7":{"id":1,"parent":{"id":2,"parent":null}}}')
    assert not params_accept(params, '{"f7":{"id":1,"parent":{"id":2,"x":1}}}')
    lark = "\n".join(["start: r0"] + [f'r{i}: "a{i}" r{i + 1} | "b"' for i in range(900)]
                     + ['r900: "z" | "(" start ")"'])   # 900 deep, recursive
    assert params_accept(StructuredOutputsParams(grammar=lark), "a0a1b")
    gbnf = "\n".join(["root ::= r0+"] + [f'r{i} ::= "x{i}" [0-9]* | r{i + 1}' for i in range(150)]
                     + ['r150 ::= "end"'])   # 150 deep, in the order its conversion likes least
    assert params_accept(StructuredOutputsParams(grammar=gbnf), "x17")


@pytest.mark.parametrize("text, num_rules, depth", [
    ('start: a\na: "r0: x" b // c: d\nb: /e: f/ "g"', 3, 3),   # strings, regexes, comments
    ("?start: a\n!a.2: b\nb[lazy]: B\nB: \"x\"", 4, 4),          # prefixes, priority, attrs
    ("start: a\na: ((b))\nb: [c]\nc: \"x\"", 4, 7),              # parentheses and [optional]
    ('start: a\na: "x" a | "y"', 2, 2),                          # recursion counts once
    ('start: %json {"type": "object", "properties": {"start": {}}}', 1, 1),
    ('start: r1\nr1 .0 : "a" r2\n  | r3\nr2 [lazy] : "b"\nr3: "c"', 4, 4),   # as llguidance
    ('start: /x\n"/ r1\nr1: "a"', 2, 2),             # a regex may span lines
    ('start: r1Z\nr1: "a"\nZ: "b"', 3, 2),          # rule and token names lexed apart
])
def test_lark_scan(text, num_rules, depth):
    scan = grammar_limits._scan(text, gbnf=False)
    assert scan.num_definitions == num_rules
    assert grammar_limits._chain_depth(scan.rules) == depth


@pytest.mark.parametrize("text, num_rules, depth", [
    ('root ::= a "::=" b # c ::= d\na ::= [a-z:] b\nb ::= "x"{2,3}', 3, 3),
    ('root ::= ( a | "x" )\na ::= "y" root', 2, 3),
])
def test_gbnf_scan(text, num_rules, depth):
    scan = grammar_limits._scan(text, gbnf=True)
    assert scan.num_definitions == num_rules
    assert grammar_limits._chain_depth(scan.rules) == depth


@pytest.mark.parametrize("text, gbnf", [
    ('start: "' + '\\"' * 60_000, False), ("start: /" + "\\/" * 60_000, False),
    ("start: " + "a[" * 60_000, False), ("start: " + "%json {}" * 15_000, False),
    ('root ::= "' + '\\"' * 60_000, True), ("root ::= [" + "\\]" * 60_000, True),
])
def test_scan_is_linear_in_any_text(text, gbnf, heap_frozen):
    """Strings and regexes left open used to be rescanned from every quote (minutes)."""
    start = time.perf_counter()
    try:
        grammar_limits.check_grammar_text(text, gbnf)
    except ValidationError:
        pass
    assert time.perf_counter() - start < TIME_BOUND_S


@pytest.mark.parametrize("kwargs, limit", [
    ({"regex": "a" * 200_000}, "MAX_GRAMMAR_CHARS"),
    ({"choice": [f"c{i}" for i in range(30_000)]}, "MAX_GRAMMAR_CHARS"),
    ({"grammar": "start: " + " | ".join(f"r{i}" for i in range(6000)) + "\n"
      + "\n".join(f'r{i}: "x"' for i in range(6000))}, "MAX_GRAMMAR_RULES = 5,000"),
    ({"grammar": 'start: %json {"type": '}, "not valid JSON"),
    ({"json": {"type": "array", "items": json.loads('{"items":' * 200 + "{}" + "}" * 200)}},
     "MAX_SCHEMA_NESTING = 128"),
    ({"json": {"enum": list(range(50_001))}}, "MAX_SCHEMA_VALUES = 50,000"),
])
def test_other_limits(kwargs, limit):
    with pytest.raises(ValidationError, match=limit):
        check_grammar(StructuredOutputsParams(**kwargs))


def test_runner_returns_raises_and_nests():
    assert grammar.run(lambda a, b: threading.current_thread().name + a + b, "-", "x") \
        .startswith("grammar-stack-")
    with pytest.raises(KeyError):
        grammar.run({}.__getitem__, "missing")
    assert grammar.run(grammar.run, threading.current_thread) is not threading.current_thread()


_STACK_PROBE = textwrap.dedent("""
    import sys, threading, llguidance
    from vllm_actors import grammar
    lines = ["start: r0"] + [f'r{i}: "a{i}" r{i + 1} | "b"' for i in range(6000)] + ['r6000: "z"']
    lark = llguidance.grammar_from("lark", "\\n".join(lines))   # past the limits on purpose
    if sys.argv[1] == "runner":
        print("ok", repr(grammar.run(llguidance.LLMatcher.validate_grammar, lark)))
    else:
        threading.stack_size(8 << 20)
        t = threading.Thread(target=llguidance.LLMatcher.validate_grammar, args=(lark,))
        t.start(); t.join(); print("ok")
""")


def test_llguidance_runs_on_the_big_stack():
    """A chain llguidance compiles with a big stack but not with an 8 MiB one: it crashes a
    plain thread and passes through `run` (each in its own process)."""
    def probe(mode):
        return subprocess.run([sys.executable, "-c", _STACK_PROBE, mode], check=False,
                              capture_output=True, text=True, timeout=120)
    plain, runner = probe("plain"), probe("runner")
    assert plain.returncode < 0 and "ok" not in plain.stdout, plain   # killed by a signal
    assert runner.returncode == 0 and runner.stdout.strip() == "ok ''", runner


def test_the_core_compiles_the_frontends_grammar_once_for_n_completions(monkeypatch):
    """The frontend's checked grammar travels in the request, so the core does not convert
    it again (a 100 KB GBNF costs ~0.3 s of Python); the n completions of one request
    share one compile and each gets its own copy of the matcher."""
    from vllm_actors.enginecore.request import Request
    from vllm_actors.enginecore.structured_output import StructuredOutputManager
    from vllm_actors.protocol.engine import EngineCoreRequest
    from vllm_actors.sampling_params import SamplingParams

    class Matcher:
        def deep_copy(self):
            return Matcher()

    compiled = []
    monkeypatch.setattr(StructuredOutputManager, "_compile",
                        lambda self, params, grammar: compiled.append(grammar) or Matcher())
    params = SamplingParams(n=3, structured_outputs=StructuredOutputsParams(regex="a+"))
    spec = check_grammar(params.structured_outputs)
    manager = StructuredOutputManager(None, 1000)
    for request in Request.children(EngineCoreRequest("r", [1, 2], params, [], 0.0, n=3,
                                                      grammar=spec), 64):
        manager.submit(request)
    matchers = []
    while manager.has_pending():
        manager.wait(5)
        ready, failed = manager.take_ready()
        assert not failed
        matchers += [request.grammar for request in ready]
    assert compiled == [spec]
    assert len({id(m) for m in matchers}) == 3 and all(isinstance(m, Matcher) for m in matchers)


def _costs_at_the_limits() -> None:
    """Prints the time of the frontend's check and the core's compile (SmolLM2's tokenizer)
    for grammars at the limits, and of the big-stack hop (docs/BENCHMARKS.md)."""
    import llguidance

    from vllm_actors.loaders.model_files import default_model_path, resolve_model
    from vllm_actors.loaders.tokenizer import load_tokenizer
    tok = load_tokenizer(resolve_model(str(default_model_path())))
    tokenizer = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=tok.vocab_size,
                                       eos_token=list(tok.eos_token_ids) or None)
    def defs(n):
        return {"$defs": {f"T{i}": {"type": "object", "required": ["id"], "properties": {
            "id": {"type": "integer"}, "name": {"type": "string", "maxLength": 20},
            "parent": {"anyOf": [{"$ref": f"#/$defs/T{i // 2}"}, {"type": "null"}]},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}},
            "score": {"type": "number"}, "ok": {"type": "boolean"}}} for i in range(n)},
            "type": "object", "properties": {f"f{i}": {"$ref": f"#/$defs/T{i}"}
                                             for i in range(0, n, max(1, n // 50))}}
    shallow = "\n".join(["start: " + " | ".join(f"r{i}" for i in range(4100))]
                        + [f'r{i}: "w{i}" /[0-9]+/' for i in range(4100)])
    gbnf = "\n".join(["root ::= " + " | ".join(f"r{i}" for i in range(4000))]
                     + [f'r{i} ::= "w{i}" [0-9]+' for i in range(4000)])
    for name, kwargs in [
            ("Lark chain of 998 rules (depth 1,000)", {"grammar": lark_chain(998)}),
            ("Lark, 4,100 shallow rules (126 KiB)", {"grammar": shallow}),
            ("GBNF chain of 280 rules (work 239,000)", {"grammar": gbnf_chain(280)}),
            ("GBNF, 4,000 shallow rules (126 KiB)", {"grammar": gbnf}),
            ("$ref chain of 165 (depth 497)", {"json": ref_chain(165)}),
            ("300 $defs (12,000 values)", {"json": defs(300)}),
            ("1,200 $defs (48,000 values)", {"json": defs(1200)}),
            ("regex, 128 KiB alternation", {"regex": "|".join(
                f"w{i}" for i in range(19000))[:131000].rstrip("|")}),
            ("choice, 14,000 strings (128 KiB)", {"choice": [f"c{i}" for i in range(14000)]})]:
        params = StructuredOutputsParams(**kwargs)
        start = time.perf_counter()
        check_grammar(params)
        checked = time.perf_counter()
        compile_matcher(tokenizer, params)
        print(f"{name}: frontend check {(checked - start) * 1000:.0f} ms, core compile "
              f"{(time.perf_counter() - checked) * 1000:.0f} ms")
    grammar.run(int)
    start = time.perf_counter()
    for _ in range(2000):
        grammar.run(int)
    print(f"big-stack hop: {(time.perf_counter() - start) / 2000 * 1e6:.1f} us per run()")


if __name__ == "__main__":
    _costs_at_the_limits()
