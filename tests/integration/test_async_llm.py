"""AsyncLLM over the engine core process: output kinds, n > 1, stop strings, streaming text,
aborts and cancellation, per-request errors, and parity with the in-process engine loop."""

import asyncio

import pytest
from msgspec.structs import replace
from parity import GREEDY_12, assert_same_or_near_tie

from vllm_actors import AsyncEngineArgs, AsyncLLM, RequestOutputKind, SamplingParams

K = RequestOutputKind


@pytest.fixture(scope="module")
def engine(smollm2_path, loop):
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(   # as `mixed_reference`; vLLM's way
        model=str(smollm2_path), gguf_activations="float32"))
    assert llm.is_running and not llm.is_stopped
    yield llm
    llm.shutdown()


async def collect(llm, prompt, params, request_id=None):
    return [out async for out in llm.generate(prompt, params, request_id)]


# The engine's event-loop state belongs to one loop: all tests of this module share it.
@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def test_output_kinds_agree(engine, loop):
    prompt = "Tell me about the moon."
    base = dict(temperature=0.0, max_tokens=20, ignore_eos=True)

    async def all_kinds():
        return await asyncio.gather(*(collect(engine, prompt, SamplingParams(**base, output_kind=k))
                                      for k in (K.DELTA, K.CUMULATIVE, K.FINAL_ONLY)))

    delta, cumulative, final = loop.run_until_complete(all_kinds())
    assert len(final) == 1 and final[0].finished
    full = final[0].outputs[0]
    assert len(full.token_ids) == 20
    assert "".join(o.outputs[0].text for o in delta) == full.text
    assert sum((o.outputs[0].token_ids for o in delta), []) == full.token_ids
    assert cumulative[-1].outputs[0].text == full.text
    assert all(b.outputs[0].text.startswith(a.outputs[0].text)
               for a, b in zip(cumulative, cumulative[1:]))
    assert [o.finished for o in delta] == [False] * (len(delta) - 1) + [True]


def test_n_with_seeds(engine, loop):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True,
                            output_kind=K.FINAL_ONLY)
    first = loop.run_until_complete(collect(engine, "Once upon a time", params))
    again = loop.run_until_complete(collect(engine, "Once upon a time", params))
    outs = first[-1].outputs
    assert [c.index for c in outs] == [0, 1, 2]
    assert [c.token_ids for c in outs] == [c.token_ids for c in again[-1].outputs]
    assert len({tuple(c.token_ids) for c in outs}) == 3
    streamed = loop.run_until_complete(collect(engine, "Once upon a time",
                                               replace(params, output_kind=K.DELTA)))
    texts = {i: "" for i in range(3)}
    for out in streamed:
        for c in out.outputs:
            texts[c.index] += c.text
    assert [texts[i] for i in range(3)] == [c.text for c in outs]
    assert streamed[-1].finished and not any(o.finished for o in streamed[:-1])


def test_stop_strings_across_tokens(engine, loop, smollm2_tokenizer):
    prompt = "The capital of France is"
    plain = loop.run_until_complete(collect(engine, prompt, SamplingParams(
        temperature=0.0, max_tokens=24, output_kind=K.FINAL_ONLY)))[-1].outputs[0]
    ids = plain.token_ids
    pieces = [smollm2_tokenizer.decode(ids[:i]) for i in range(len(ids) + 1)]
    # a stop string made of the end of one token and the start of the next
    i = next(i for i in range(2, len(ids)) if len(pieces[i]) - len(pieces[i - 1]) >= 2
             and len(pieces[i + 1]) - len(pieces[i]) >= 2)
    stop = pieces[i][-2:] + pieces[i + 1][len(pieces[i]):][:2]
    cut = plain.text.index(stop)
    for include in (False, True):
        params = SamplingParams(temperature=0.0, max_tokens=24, stop=["zzz-never", stop],
                                include_stop_str_in_output=include, output_kind=K.DELTA)
        streamed = loop.run_until_complete(collect(engine, prompt, params))
        text = "".join(o.outputs[0].text for o in streamed)
        last = streamed[-1].outputs[0]
        assert text == plain.text[:cut + (len(stop) if include else 0)]
        assert last.finish_reason == "stop" and last.stop_reason == stop
        if not include:   # the partial stop string was never streamed
            assert all(stop[:2] not in o.outputs[0].text for o in streamed)


def test_cjk_and_emoji_stream_cleanly(engine, loop):
    for prompt in ("東京は日本の首都であり、", "Write three emoji about the sea: 🌊"):
        params = SamplingParams(temperature=0.0, max_tokens=40, output_kind=K.DELTA)
        streamed = loop.run_until_complete(collect(engine, prompt, params))
        assert all("\ufffd" not in o.outputs[0].text for o in streamed[:-1])
        assert any(ord(ch) > 0x2E80 for o in streamed for ch in o.outputs[0].text)


def test_stop_string_inside_multibyte_text(engine, loop):
    prompt = "東京は日本の首都であり、"
    full = loop.run_until_complete(collect(engine, prompt, SamplingParams(
        temperature=0.0, max_tokens=40, output_kind=K.FINAL_ONLY)))[-1].outputs[0].text
    stop = next(ch for ch in full[3:] if ord(ch) > 0x2E80)
    out = loop.run_until_complete(collect(engine, prompt, SamplingParams(
        temperature=0.0, max_tokens=40, stop=[stop], output_kind=K.FINAL_ONLY)))[-1].outputs[0]
    assert out.text == full[:full.index(stop)] and out.stop_reason == stop


def test_cancelling_the_consumer_aborts_in_the_core(engine, loop):
    async def scenario():
        params = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True,
                                output_kind=K.DELTA)
        seen = 0

        async def consume():
            nonlocal seen
            async for _ in engine.generate("Count forever:", params, "to-cancel"):
                seen += 1

        task = asyncio.create_task(consume())
        while seen < 3:
            await asyncio.sleep(0.01)
        running = (await engine.get_scheduler_stats()).num_running_reqs
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.3)
        return running, await engine.get_scheduler_stats()

    running, after = loop.run_until_complete(scenario())
    assert running == 1
    assert after.num_running_reqs == 0 and after.num_waiting_reqs == 0
    assert "to-cancel" not in engine.output_processor.children


def test_abort_gives_a_final_output(engine, loop):
    async def scenario():
        params = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True,
                                output_kind=K.DELTA)
        outs = []
        async for out in engine.generate("Count forever:", params, "to-abort"):
            outs.append(out)
            if len(outs) == 2:
                await engine.abort("to-abort")
        return outs

    outs = loop.run_until_complete(scenario())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"


def test_ids_in_flight_are_refused_and_their_requests_finish(engine, loop):
    """An id already running is a ValueError before anything is sent, and a non-str id a
    TypeError; ids that look like another's completions ("0_x" beside "x" with n = 2) run
    apart (the core knows each request by an id of its own), and the requests already
    running finish (they had been left waiting forever)."""
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    async def scenario():
        running = [asyncio.create_task(collect(engine, "A", long, "0_x")),
                   asyncio.create_task(collect(engine, "A", replace(long, n=2), "y"))]
        await asyncio.sleep(0.2)
        for request_id in ("0_x", "y"):
            with pytest.raises(ValueError, match="already in use"):
                await collect(engine, "B", long, request_id)
        with pytest.raises(TypeError, match="request_id must be a str"):
            await collect(engine, "B", long, 5)
        running += [asyncio.create_task(collect(engine, "A", replace(long, n=2), "x")),
                    asyncio.create_task(collect(engine, "A", long, "0_y"))]
        return await asyncio.gather(*running)

    for outs in loop.run_until_complete(scenario()):
        assert outs[-1].finished
        assert {len(c.token_ids) for c in outs[-1].outputs} == {40}


def test_an_id_used_again_right_after_an_abort_gets_only_its_own_tokens(engine, loop):
    """A request closed after its first output, and its id used at once for another: the
    aborted request's tokens still on their way went to the new one (every time, measured),
    which then ran past its max_tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=8, output_kind=K.FINAL_ONLY)
    long = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)

    async def scenario():
        alone = (await collect(engine, "Name a colour.", params))[-1].outputs[0].token_ids
        for _ in range(3):
            stream = engine.generate("Tell me a story.", long, "X")
            async for _ in stream:
                break
            await stream.aclose()
            again = (await collect(engine, "Name a colour.", params, "X"))[-1]
            assert again.outputs[0].token_ids == alone

    loop.run_until_complete(scenario())


def test_bad_request_fails_alone(engine, loop):
    async def scenario():
        good = asyncio.create_task(collect(engine, "Hello", SamplingParams(
            temperature=0.0, max_tokens=8, output_kind=K.FINAL_ONLY)))
        engine.input_processor.vocab_size = 10 ** 9   # let a bad id through to the core
        try:
            bad = await collect(engine, {"prompt_token_ids": [1, 60000]}, SamplingParams(
                max_tokens=4, output_kind=K.FINAL_ONLY))
        finally:
            engine.input_processor.vocab_size = engine.ready.vocab_size
        return bad, await good

    bad, good = loop.run_until_complete(scenario())
    assert bad[-1].outputs[0].finish_reason == "error"
    assert "prompt token ids must be in [0, 49152)" in bad[-1].error
    assert good[-1].outputs[0].finish_reason == "length"
    loop.run_until_complete(engine.check_health())


def test_same_tokens_as_the_in_process_loop(engine, loop, smollm2_model, mixed_prompts,
                                            mixed_reference):
    """16 of the mixed prompts (8..600 tokens, every other one) at once through AsyncLLM (the core
    in its own process) give the tokens of the in-process engine loop (conftest's
    `mixed_reference`): more than one step's token budget, so chunked prefills and decodes of
    concurrent requests share steps across the process split."""
    prompts = mixed_prompts[::2]

    async def through_async_llm():
        params = replace(GREEDY_12, output_kind=K.FINAL_ONLY)
        results = await asyncio.gather(*(collect(engine, p, params, f"parity-{i}")
                                         for i, p in enumerate(prompts)))
        return [r[-1].outputs[0].token_ids for r in results]

    async_tokens = loop.run_until_complete(through_async_llm())
    in_process = mixed_reference.of(prompts, GREEDY_12.max_tokens)
    assert_same_or_near_tie(smollm2_model, prompts, in_process, async_tokens)
