"""Structured outputs through the engine on SmolLM2 (in-process LLM): constrained and free
requests in one batch, grammar completion ends a request, pending grammars can be aborted."""

from __future__ import annotations

import json

import numpy as np
import pytest

from vllm_actors.enginecore.request import Request
from vllm_actors.enginecore.structured_output import StructuredOutputManager
from vllm_actors.protocol.engine import EngineCoreRequest
from vllm_actors.sampling_params import SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0,
                                                      "maximum": 99}},
          "required": ["answer"], "additionalProperties": False}
PROMPT = [{"role": "user", "content": "What is 2+2? Answer in JSON."}]


def test_constrained_rows_do_not_disturb_free_ones(smollm2_llm):
    free = SamplingParams(temperature=0, max_tokens=12)
    alone = smollm2_llm.chat(PROMPT, free)[0].outputs[0].token_ids
    constrained = SamplingParams(temperature=0, max_tokens=40,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    outs = smollm2_llm.chat([PROMPT, PROMPT, PROMPT], [free, constrained, free])
    assert outs[0].outputs[0].token_ids == alone == outs[2].outputs[0].token_ids
    done = outs[1].outputs[0]
    assert json.loads(done.text)["answer"] in range(100)
    assert done.finish_reason == "stop"   # ended by the complete grammar, text kept whole
    assert done.text.endswith("}")


def test_choice_with_n_samples(smollm2_llm):
    params = SamplingParams(n=6, temperature=1.5, seed=1, max_tokens=10,
                            structured_outputs=StructuredOutputsParams(
                                choice=["alpha", "beta", "gamma"]))
    [out] = smollm2_llm.generate("Pick a Greek letter:", params)
    assert {c.text for c in out.outputs} <= {"alpha", "beta", "gamma"}
    assert all(c.finish_reason == "stop" for c in out.outputs)


@pytest.fixture(scope="module")
def manager(smollm2_path):
    return StructuredOutputManager(str(smollm2_path), 49152)


def _request(req_id: str, so: StructuredOutputsParams) -> Request:
    return Request(EngineCoreRequest(req_id, [1, 2, 3], SamplingParams(structured_outputs=so),
                                     [2], 0.0), 8192)


def test_bitmask_allows_only_grammar_tokens(manager, smollm2_tokenizer):
    request = _request("r", StructuredOutputsParams(choice=["yes", "no"]))
    manager.submit(request)
    while manager.has_pending():
        manager.wait(1.0)
        ready, failed = manager.take_ready()
    assert ready == [request] and failed == []
    bits = np.unpackbits(np.frombuffer(manager.bitmask([request]), np.uint8),
                         bitorder="little")[:49152]
    allowed = {smollm2_tokenizer.decode([t]) for t in np.flatnonzero(bits).tolist()}
    assert allowed and all("yes".startswith(a) or "no".startswith(a) for a in allowed)
    for token in smollm2_tokenizer.encode("no", add_special_tokens=False):
        request.append_output_token(token)
    assert request.check_stop() and request.finish_reason is not None
    assert request.grammar.is_stopped()


def test_pending_grammar_abort_and_failure(manager):
    good = _request("a", StructuredOutputsParams(regex="[0-9]+"))
    manager.submit(good)
    assert manager.abort(["a", "unknown"]) == ["a"] and not manager.has_pending()
    # a grammar the frontend would have refused fails its request alone
    bad = _request("b", StructuredOutputsParams(regex="a(b"))
    manager.submit(bad)
    while manager.has_pending():
        manager.wait(1.0)
        ready, failed = manager.take_ready()
    assert ready == [] and failed[0][0] is bad and "unclosed group" in failed[0][1]


def test_a_grammar_the_core_refuses_fails_that_request_as_its_own_fault(smollm2_path,
                                                                        monkeypatch):
    """A grammar the frontend's check lets through but the core's compile refuses (as
    llguidance limits can) fails that request alone with error_param structured_outputs,
    which the server answers as a 400 naming the constraint field; a free request beside
    it is served."""
    import asyncio

    from vllm_actors import AsyncLLM
    from vllm_actors.errors import ValidationError
    from vllm_actors.frontend.openai_schema import APIError
    from vllm_actors.frontend.serving import raise_if_failed

    def refuse(self, params, grammar):
        raise ValidationError("invalid regex: beyond the grammar library's limits",
                              "structured_outputs")

    monkeypatch.setattr(StructuredOutputManager, "_compile", refuse)
    llm = AsyncLLM(str(smollm2_path), multiprocessing=False)   # the patched core in a thread

    async def final(prompt, params, request_id):
        out = None
        async for out in llm.generate(prompt, params, request_id):
            pass
        return out

    async def scenario():
        constrained = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
            regex="a+"))
        return await asyncio.gather(final("Hi", constrained, "bad"),
                                    final("Hi", SamplingParams(max_tokens=4), "good"))

    try:
        bad, good = asyncio.run(scenario())
    finally:
        llm.shutdown()
    assert bad.outputs[0].finish_reason == "error" and bad.error_param == "structured_outputs"
    assert "beyond the grammar library's limits" in bad.error
    assert good.outputs[0].finish_reason == "length" and good.error is None
    with pytest.raises(APIError) as refused:
        raise_if_failed(bad, "guided_regex")
    assert refused.value.status == 400 and refused.value.param == "guided_regex"
