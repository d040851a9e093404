"""The official openai client against a real `vllm-actors serve` on SmolLM2."""

import pytest

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_models(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["smol"]


def test_chat(client):
    r = client.chat.completions.create(model="smol", messages=QUESTION, temperature=0,
                                       max_tokens=32)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and "Paris" in choice.message.content
    assert choice.finish_reason == "stop"
    assert r.usage.prompt_tokens == 37 and r.usage.total_tokens == 37 + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_stream_equals_non_stream_for_greedy(client, endpoint):
    if endpoint == "chat":
        kw = dict(model="smol", messages=QUESTION, temperature=0, max_tokens=40)
        full = client.chat.completions.create(**kw).choices[0].message.content
        chunks = list(client.chat.completions.create(**kw, stream=True))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[0].choices[0].delta.role == "assistant"
    else:
        kw = dict(model="smol", prompt="Once upon a time", temperature=0, max_tokens=40)
        full = client.completions.create(**kw).choices[0].text
        chunks = list(client.completions.create(**kw, stream=True))
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == full and len(full) > 20
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_completions_prompt_forms_and_echo(client):
    r = client.completions.create(model="smol", prompt=["The capital of France is", "1, 2, 3,"],
                                  temperature=0, max_tokens=5, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text  # greedy: both completions agree
    ids = client.completions.create(model="smol", prompt=[504, 3575, 282, 4649, 314],
                                    temperature=0, max_tokens=5, echo=True)
    assert ids.choices[0].text.startswith("The capital of France is")
    assert ids.choices[0].text[len("The capital of France is"):] == r.choices[0].text
    lists = client.completions.create(model="smol", prompt=[[504, 3575], [33, 28]],
                                      temperature=0, max_tokens=3)
    assert len(lists.choices) == 2 and lists.usage.prompt_tokens == 4


def test_n_and_seed(client):
    kw = dict(model="smol", messages=QUESTION, temperature=1.0, max_tokens=12, n=3, seed=11)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    texts = [c.message.content for c in a.choices]
    assert texts == [c.message.content for c in b.choices]
    assert len(set(texts)) > 1 and [c.index for c in a.choices] == [0, 1, 2]


def test_stop_and_max_tokens(client):
    kw = dict(model="smol", prompt="The capital of France is", temperature=0)
    full = client.completions.create(**kw, max_tokens=20).choices[0].text
    stop = full[6:9]
    r = client.completions.create(**kw, max_tokens=20, stop=[stop])
    assert r.choices[0].text == full[:full.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    short = client.completions.create(**kw, max_tokens=3)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3


def test_stream_options_usage(client):
    chunks = list(client.chat.completions.create(
        model="smol", messages=QUESTION, temperature=0, max_tokens=10, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == 37
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].usage.completion_tokens == 10 or chunks[-2].choices[0].finish_reason == "stop"
