"""The public offline API on the real default model: generate, chat, stream, stop rules,
seeds, and the errors a user gets for bad input."""

import pytest

from vllm_actors import LLM, SamplingParams
from vllm_actors.errors import ModelNotFoundError, ValidationError

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def test_generate_shapes_and_order(smollm2_llm):
    prompts = ["The capital of France is", {"prompt_token_ids": [504, 3575, 282, 4649, 314]},
               "def add(a, b):"]
    outs = smollm2_llm.generate(prompts, GREEDY)
    assert [o.request_id for o in outs] == sorted((o.request_id for o in outs), key=int)
    assert outs[0].prompt == "The capital of France is"
    assert outs[1].prompt is None
    assert outs[0].prompt_token_ids == outs[1].prompt_token_ids == [504, 3575, 282, 4649, 314]
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert outs[0].outputs[0].text.startswith(" Paris")
    for out in outs:
        completion = out.outputs[0]
        assert out.finished and completion.finish_reason == "length"
        assert len(completion.token_ids) == 12
        assert completion.text == smollm2_llm.get_tokenizer().decode(completion.token_ids,
                                                                     skip_special_tokens=True)
        assert out.num_cached_tokens == 0


def test_chat_stops_at_eos(smollm2_llm):
    out = smollm2_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                           SamplingParams(temperature=0.0, max_tokens=64))[0]
    completion = out.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason is None
    assert completion.token_ids[-1] == 2  # <|im_end|>, the EOS, kept in token_ids
    assert "Paris" in completion.text and "<|im_end|>" not in completion.text


def test_chat_takes_text_parts_template_kwargs_and_an_open_final_message(smollm2_llm):
    """vLLM's LLM.chat arguments: OpenAI text parts are joined as the server joins them,
    chat_template_kwargs reach the template, continue_final_message leaves the last
    message open (with add_generation_prompt, a ValueError)."""
    params = SamplingParams(temperature=0.0, max_tokens=8)
    plain = [{"role": "user", "content": "Hi\nthere"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"},
                                          {"type": "text", "text": "there"}]}]
    a, b = smollm2_llm.chat([plain, parts], params)
    assert a.prompt_token_ids == b.prompt_token_ids and a.outputs[0].text == b.outputs[0].text
    shown = smollm2_llm.chat(plain, params, chat_template="{{ greeting }} {{ messages[0]"
                             "['content'] }}", chat_template_kwargs={"greeting": "Hello"})[0]
    assert shown.prompt == "Hello Hi\nthere"
    documents = smollm2_llm.engine.input_processor.chat_prompt(   # the server's `documents`
        plain, "{{ documents[0].text }}", documents=[{"text": "D"}])
    assert documents["prompt"] == "D"
    opened = [*plain, {"role": "assistant", "content": "The answer is"}]
    out = smollm2_llm.chat(opened, params, add_generation_prompt=False,
                           continue_final_message=True)[0]
    assert out.prompt.endswith("The answer is")
    with pytest.raises(ValueError, match="continue_final_message"):
        smollm2_llm.chat(opened, params, continue_final_message=True)
    with pytest.raises(ValueError, match="only text parts"):
        smollm2_llm.chat([{"role": "user", "content": [{"type": "image_url"}]}], params)


def test_detokenize_off_and_lists_given_as_none(smollm2_llm):
    """vLLM's detokenize=False (token ids only; stop strings refused) and None for its
    optional lists."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, stop=None,
                            stop_token_ids=None, bad_words=None, detokenize=False,
                            extra_args={"mine": 1})
    out = smollm2_llm.generate("Hello", params)[0].outputs[0]
    assert out.text == "" and len(out.token_ids) == 4
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)


def test_ignore_eos_runs_to_max_tokens(smollm2_llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = smollm2_llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=40,
                                                    ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 40 and 2 in out.token_ids


def test_stop_token_ids_and_min_tokens(smollm2_llm):
    base = smollm2_llm.generate("The capital of France is", GREEDY)[0].outputs[0].token_ids
    stop_at = base[3]
    out = smollm2_llm.generate("The capital of France is", SamplingParams(
        temperature=0.0, max_tokens=12, stop_token_ids=[stop_at]))[0].outputs[0]
    assert out.token_ids == base[:base.index(stop_at) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    late = smollm2_llm.generate("The capital of France is", SamplingParams(
        temperature=0.0, max_tokens=12, stop_token_ids=[base[0]], min_tokens=2))[0].outputs[0]
    # vLLM's rule: stop ids (and EOS) are masked until min_tokens are out
    assert base[0] not in late.token_ids[:2] and len(late.token_ids) >= 2


def test_seeded_sampling_is_reproducible(smollm2_llm):
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=16)
    a = smollm2_llm.generate("Once upon a time", params)[0].outputs[0].token_ids
    b = smollm2_llm.generate("Once upon a time", params)[0].outputs[0].token_ids
    c = smollm2_llm.generate("Once upon a time", SamplingParams(
        temperature=1.0, seed=99, max_tokens=16))[0].outputs[0].token_ids
    assert a == b and a != c


def test_stream_yields_the_full_text(smollm2_llm):
    params = SamplingParams(temperature=0.0, max_tokens=20)
    pieces = list(smollm2_llm.stream("Tokyo is the capital of", params))
    full = smollm2_llm.generate("Tokyo is the capital of", params)[0].outputs[0].text
    assert len(pieces) > 3 and "".join(pieces) == full


def test_stream_holds_back_partial_utf8(smollm2_llm):
    params = SamplingParams(temperature=0.0, max_tokens=24)
    prompt = "東京は日本の首都であり、"
    pieces = list(smollm2_llm.stream(prompt, params))
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == smollm2_llm.generate(prompt, params)[0].outputs[0].text


def test_bad_inputs(smollm2_llm):
    with pytest.raises(ValidationError, match="prompt is empty"):
        smollm2_llm.generate({"prompt_token_ids": []}, GREEDY)
    with pytest.raises(ValidationError, match="out of range for a vocabulary of 49152"):
        smollm2_llm.generate({"prompt_token_ids": [1, 49152]}, GREEDY)
    with pytest.raises(ValidationError, match="2 prompts but 1 sampling_params"):
        smollm2_llm.generate(["a", "b"], [GREEDY])
    with pytest.raises(ValidationError, match="a prompt must be a string"):
        smollm2_llm.generate([42], GREEDY)
    with pytest.raises(ValidationError, match="prompts must be a string.*got NoneType"):
        smollm2_llm.generate(None, GREEDY)
    with pytest.raises(ValidationError, match="sampling_params must be a SamplingParams.*dict"):
        smollm2_llm.generate("a", {"max_tokens": 3})
    with pytest.raises(ValidationError, match="2 prompts but 3 priority entries"):
        smollm2_llm.generate(["a", "b"], GREEDY, priority=[0, 1, 2])
    # nothing was left behind by the failed calls
    assert not smollm2_llm.engine.output_processor.has_unfinished_requests()
    stats = smollm2_llm._run(smollm2_llm.engine.get_scheduler_stats())
    assert stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0


def test_prompt_longer_than_max_model_len(smollm2_path):
    with LLM(str(smollm2_path), max_model_len=32) as llm:
        with pytest.raises(ValidationError, match=r"maximum context length is 32 tokens "
                                                  r"\(max_model_len\)\. However, the prompt "
                                                  "has 40 tokens"):
            llm.generate({"prompt_token_ids": [100] * 40}, GREEDY)
        out = llm.generate({"prompt_token_ids": [100] * 28}, SamplingParams(
            temperature=0, max_tokens=100))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4


def test_bad_engine_arguments(smollm2_path, tmp_path):
    with pytest.raises(ValidationError, match="unknown engine argument.*max_modle_len"):
        LLM(str(smollm2_path), max_modle_len=5)
    with pytest.raises(ValidationError, match="larger than the model's context length"):
        LLM(str(smollm2_path), max_model_len=100_000)
    with pytest.raises(ValidationError, match="fewer than one request of max_model_len"):
        LLM(str(smollm2_path), max_model_len=256, num_gpu_blocks_override=4)
    with pytest.raises(ModelNotFoundError, match="no such model"):
        LLM(str(tmp_path / "missing.gguf"))


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -1}, "temperature must be a finite number >= 0"),
    ({"max_tokens": 0}, "max_tokens must be at least 1"),
    ({"min_tokens": 5, "max_tokens": 2}, r"min_tokens \(5\) must be <= max_tokens \(2\)"),
    ({"n": 0}, "n must be between 1 and 128"),
    ({"stop": [""]}, "stop must be a list of non-empty strings"),
    ({"stop_token_ids": [-3]}, "stop_token_ids must be non-negative"),
    ({"seed": "x"}, r"seed: Expected `int \| null`, got `str`"),
    ({"seed": 2**64}, r"seed must be an integer in \[-2\^63, 2\^64\)"),
    ({"n": True}, "n: Expected `int`, got `bool`"),
    ({"top_k": 10**30}, "top_k holds an integer beyond 64 bits"),
    ({"logit_bias": {"a": 1}}, "logit_bias must map token ids to numbers"),
    ({"stop": [1]}, r"stop: Expected `str`, got `int`"),
])
def test_sampling_params_validation(kwargs, message):
    with pytest.raises(ValidationError, match=message) as refused:
        SamplingParams(**kwargs)
    assert refused.value.param in kwargs


def test_seeds_beyond_int64_generate(smollm2_llm):
    """Once an OverflowError that killed the engine: seeds up to 2^64 - 1 (and n > 1 past
    it, wrapping to 0) sample reproducibly, and the engine serves on."""
    params = SamplingParams(temperature=1.0, seed=2**64 - 1, n=2, max_tokens=6)
    first, again = (smollm2_llm.generate("Once", params)[0] for _ in range(2))
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    wrapped = smollm2_llm.generate("Once", SamplingParams(temperature=1.0, seed=0,
                                                          max_tokens=6))[0]
    assert first.outputs[1].token_ids == wrapped.outputs[0].token_ids
    assert smollm2_llm.generate("Once", GREEDY)[0].outputs[0].finish_reason in ("stop",
                                                                                 "length")


def test_collective_rpc_through_the_frontend(smollm2_llm):
    """LLM.collective_rpc goes through the core's utility path to the worker ranks."""
    from vllm_actors.errors import VllmActorsError
    (rank,) = smollm2_llm.collective_rpc("describe")
    assert rank["rank"] == 0 and rank["world_size"] == 1 and rank["num_kv_blocks"] > 0
    with pytest.raises(VllmActorsError, match="unknown method 'nope'"):
        smollm2_llm.collective_rpc("nope")
    assert smollm2_llm.generate(["Hi"], GREEDY)[0].outputs[0].token_ids   # still serving
