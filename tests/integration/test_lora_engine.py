"""LoRA through the whole engine on SmolLM2 (compiled CPU backend, --enable-lora):
PEFT's greedy tokens, llama.cpp's with a GGUF adapter, a batch of four adapters and the base model giving each request what
it gets alone while --max-loras 2 makes requests wait and a small KV cache preempts them,
prefix-cache blocks kept per adapter, and the errors a user can cause."""

from __future__ import annotations

import json

import numpy as np
import pytest
from golden_files import GOLDEN
from tiny_lora import (SMOLLM2_GGUF_LORA, SMOLLM2_LORA, SMOLLM2_SHAPES, write_gguf_adapter,
                       write_peft_adapter)

from vllm_actors import LLM, LoRARequest, SamplingParams, ValidationError

GOLDENS = np.load(GOLDEN / "lora.npz")
STEPS = 24
# each request of the mixed batch holds about 8 blocks (about 100 prompt + 24 tokens); five
# do not fit at once
NUM_BLOCKS = 28


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    paths = [write_peft_adapter(root / "golden", SMOLLM2_SHAPES, **SMOLLM2_LORA)]
    paths += [write_peft_adapter(root / f"a{i}", SMOLLM2_SHAPES, rank=8, alpha=16.0, seed=i)
              for i in (2, 3, 4)]
    return [LoRARequest(f"a{i}", i, str(p)) for i, p in enumerate(paths, 1)]


@pytest.fixture(scope="module")
def lora_llm(smollm2_path):
    with LLM(str(smollm2_path), device="cpu", gguf_activations="float32", enable_lora=True,
             max_loras=2, max_num_seqs=8, max_model_len=256,
             num_gpu_blocks_override=NUM_BLOCKS) as llm:
        yield llm


def greedy(steps: int = STEPS) -> SamplingParams:
    return SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)


def test_golden_adapter_gives_peft_tokens(lora_llm, adapters):
    prompt = {"prompt_token_ids": GOLDENS["smollm2/prompt"].tolist()}
    out = lora_llm.generate(prompt, greedy(32), lora_request=adapters[0])[0]
    want, margins = GOLDENS["smollm2/greedy"].tolist(), GOLDENS["smollm2/margins"]
    got = out.outputs[0].token_ids
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    assert first is None or margins[first] < 1e-3, (first, got, want)


def test_mixed_batch_equals_each_request_alone(lora_llm, adapters, smollm2_tokenizer):
    text = " ".join(f"Item {k}: {k} squared is {k * k}." for k in range(1, 12))
    prompts = [{"prompt_token_ids": smollm2_tokenizer.encode(text)}] * 5
    loras = [None, *adapters]
    alone = [lora_llm.generate(p, greedy(), lora_request=lora)[0].outputs[0].token_ids
             for p, lora in zip(prompts, loras)]
    # the strong adapters change the output (a1, the golden one, is mild: checked above)
    assert all(tokens != alone[0] for tokens in alone[2:])
    preempted = lora_llm.get_metrics()["vllm:num_preemptions"]
    together = lora_llm.generate(prompts, greedy(), lora_request=loras)
    assert [o.outputs[0].token_ids for o in together] == alone
    assert lora_llm.get_metrics()["vllm:num_preemptions"] > preempted


def test_prefix_cache_is_kept_per_adapter(lora_llm, adapters, smollm2_tokenizer):
    prompt = {"prompt_token_ids": smollm2_tokenizer.encode("shared prefix " * 30)}
    first = lora_llm.generate(prompt, greedy(2), lora_request=adapters[1])[0]
    again = lora_llm.generate(prompt, greedy(2), lora_request=adapters[1])[0]
    other = lora_llm.generate(prompt, greedy(2), lora_request=adapters[2])[0]
    base = lora_llm.generate(prompt, greedy(2))[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > 0
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0


def test_adapter_errors(lora_llm, adapters, smollm2_llm, tmp_path):
    with pytest.raises(ValidationError, match="no such PEFT directory"):
        lora_llm.generate("hi", greedy(2), lora_request=LoRARequest("gone", 9, "/nonexistent"))
    with pytest.raises(ValidationError, match="loaded under that name or id"):
        lora_llm.add_lora(LoRARequest("a1", 7, adapters[1].lora_path))
    with pytest.raises(ValidationError, match="--enable-lora"):
        smollm2_llm.generate("hi", greedy(2), lora_request=adapters[0])
    with pytest.raises(ValidationError, match="lora_int_id"):
        LoRARequest("x", 0, "/p")
    # unloaded: new requests are refused until it is added again
    assert lora_llm.remove_lora(adapters[3].lora_int_id)
    assert adapters[3].lora_int_id not in lora_llm.list_loras()
    assert lora_llm.generate("hi", greedy(2), lora_request=adapters[3])[0].finished
    assert lora_llm.generate("hi", greedy(2))[0].finished        # the engine is still up


def llamacpp_spread_bound() -> float:
    """The largest top-2 margin at which llama.cpp parts from itself on SmolLM2 across
    thread counts and batch shapes (tests/golden/llamacpp_spread.json; flash attention, a
    different attention algorithm, left out). It never does: the bound is 0, so the tokens
    must be llama.cpp's exactly."""
    spread = json.loads((GOLDEN / "llamacpp_spread.json").read_text())["models"]["smollm2"]
    return max(run["margin_at_divergence"] or 0.0 for case in spread.values()
               for config, run in case.items() if "flash_attn" not in config)


def test_gguf_adapters_give_llamacpp_tokens(smollm2_path, tmp_path, monkeypatch):
    """llama.cpp GGUF adapters, F32 and F16 (`convert_lora_to_gguf.py`'s outtypes), under the
    default semantics, side by side in one batch: llama.cpp's greedy tokens with the same
    adapter loaded (tests/oracle/make_llamacpp_lora_golden.py), a difference allowed only at
    a margin below llama.cpp's own spread. The golden came from an AVX-512 build, whose
    16-lane orders are emulated on any host (as `test_llamacpp_parity.py` does): an AVX2
    host's own attention parted from it at step 7 of a case."""
    monkeypatch.setenv("VLLM_ACTORS_GGML_WIDTH", "16")
    cases, loras = [], []
    for lora_id, (dtype, name) in enumerate((("F32", "llamacpp_smollm2_lora.json"),
                                             ("F16", "llamacpp_smollm2_lora_f16.json")), 1):
        golden = json.loads((GOLDEN / name).read_text())
        adapter = write_gguf_adapter(tmp_path / f"{dtype}.gguf", SMOLLM2_SHAPES,
                                     **SMOLLM2_GGUF_LORA, dtype=dtype)
        cases += [(dtype, c) for c in golden["cases"]]
        loras += [LoRARequest(dtype, lora_id, str(adapter))] * len(golden["cases"])
    bound = llamacpp_spread_bound()
    # blocks for all 12 at once: a preempted request's recomputed tokens would take the
    # multi-row order, which llama.cpp, decoding them one by one, never used
    prompts = [{"prompt_token_ids": c["prompt_token_ids"]} for _, c in cases]
    with LLM(str(smollm2_path), device="cpu", enable_lora=True, max_loras=2,
             max_model_len=256, num_gpu_blocks_override=96) as llm:
        outs = llm.generate(prompts, greedy(32), lora_request=loras)
        # a request alone decodes with the delta inside each GEMV (`lora_gemv`)
        alone = [len(cases) // 2 - 1, len(cases) - 1]           # the last of each dtype
        for i in alone:
            outs += llm.generate(prompts[i], greedy(32), lora_request=loras[i])
        cases += [cases[i] for i in alone]
    for (dtype, case), out in zip(cases, outs):
        got, want = out.outputs[0].token_ids, case["tokens"]
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        assert first is None or case["top2_margins"][first] < bound, (dtype, case["name"],
                                                                      first, bound)
