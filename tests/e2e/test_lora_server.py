"""LoRA adapters through a real `vllm-actors serve` on SmolLM2, with the openai client:
an adapter from --lora-modules by name (streaming equals non-streaming; the base model
answers otherwise), /v1/models, runtime load / use / unload / use again under
VLLM_ALLOW_RUNTIME_LORA_UPDATING, the 4xx answers, and the LoRA metric."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_process import ServerProcess
from tiny_lora import SMOLLM2_SHAPES, write_peft_adapter

PROMPT = "Write one sentence about the sea."


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {"strong": write_peft_adapter(root / "strong", SMOLLM2_SHAPES, rank=8, alpha=16.0,
                                         seed=3),
            "other": write_peft_adapter(root / "other", SMOLLM2_SHAPES, rank=8, alpha=16.0,
                                        seed=4),
            "too_wide": write_peft_adapter(root / "wide", SMOLLM2_SHAPES, rank=32, seed=5)}


@pytest.fixture(scope="module")
def server(adapters, smollm2_path):
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    proc = ServerProcess(str(smollm2_path), "--served-model-name", "smol", "--enable-lora",
                         "--max-loras", "2", "--max-model-len", "1024",
                         "--lora-modules", f"sea={adapters['strong']}")
    mp.undo()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none")


def complete(client, model: str, stream: bool = False) -> str:
    kw = dict(model=model, prompt=PROMPT, temperature=0, max_tokens=24)
    if not stream:
        return client.completions.create(**kw).choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True)
                   if c.choices)


def test_adapter_by_name_streams_and_differs_from_the_base(server, client):
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"smol", "sea"}
    assert models["sea"].parent == "smol" and models["smol"].parent is None
    sea = complete(client, "sea")
    assert sea == complete(client, "sea", stream=True) and sea != complete(client, "smol")
    chat = client.chat.completions.create(
        model="sea", messages=[{"role": "user", "content": PROMPT}], max_tokens=8, stream=True)
    chunks = list(chat)
    assert chunks[0].model == "sea"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        complete(client, "nope")
    assert client.models.retrieve("sea").parent == "smol"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("nope")
    # off by default, as in vLLM
    assert httpx.get(server.url + "/tokenizer_info").status_code == 404


def test_runtime_load_use_unload(server, client, adapters):
    post = lambda path, body: httpx.post(server.url + path, json=body, timeout=60)  # noqa: E731
    assert post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/nonexistent"}
                ).status_code == 404
    wide = post("/v1/load_lora_adapter", {"lora_name": "x",
                                          "lora_path": str(adapters["too_wide"])})
    assert wide.status_code == 400 and "--max-lora-rank" in wide.json()["error"]["message"]
    assert post("/v1/load_lora_adapter", {"lora_name": "sea", "lora_path":
                                          str(adapters["other"])}).status_code == 400
    assert post("/v1/load_lora_adapter", {"lora_name": "x"}).status_code == 400
    ok = post("/v1/load_lora_adapter", {"lora_name": "other", "lora_path":
                                        str(adapters["other"])})
    assert ok.status_code == 200 and "added successfully" in ok.text
    first = complete(client, "other")
    assert first not in (complete(client, "sea"), complete(client, "smol"))
    assert post("/v1/unload_lora_adapter", {"lora_name": "other"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        complete(client, "other")
    assert post("/v1/unload_lora_adapter", {"lora_name": "other"}).status_code == 404
    assert post("/v1/load_lora_adapter", {"lora_name": "other", "lora_path":
                                          str(adapters["other"])}).status_code == 200
    assert complete(client, "other") == first
    metrics = httpx.get(server.url + "/metrics").text
    assert 'vllm:lora_requests_info{max_lora="2"' in metrics
    assert httpx.get(server.url + "/health").status_code == 200
