"""--kv-cache-dtype through the whole engine on SmolLM2 (the default device, the compiled CPU
backend).

- The gate for float16, bfloat16 and fp8: greedy tokens equal transformers' golden tokens
  (a float32 oracle) except where they first differ at a near-tie of the float32 logits.
  "Near" is per dtype, from what the format's rounding moves logits by on this model
  (bench/kv_accuracy.py on SmolLM2: float16 / bfloat16 mean KL 6e-7 / 4e-5 against the
  float32 cache, and no golden token changes; fp8 e4m3 / e5m2 mean KL 0.010 / 0.037, top-1
  agreement 95 % / 91 %, and first changes measured at float32 margins up to 0.55 / 0.65).
  float16 and bfloat16 may change at most a few prompts, so a broken 16-bit path fails.
- Chunked prefill, preemption and prefix caching with turboquant (fp8 is the same uint8 path;
  measured 507/512 agreeing tokens with it too): a batch that is
  chunked and preempted, then each prompt again from the prefix cache, gives the tokens of
  a plain prefill over the same dtype's cache (near-ties of that dtype's own logits aside:
  chunking changes float rounding, which may move a quantized value across a code boundary).
"""

from __future__ import annotations

import numpy as np
import pytest
from golden_files import load_golden
from model_driver import prompt_logits
from oracle.prompts import LONG_ESSAY

from vllm_actors import LLM, SamplingParams
from vllm_actors.kernels.kv_quant import kv_format

GOLDEN = load_golden("smollm2_greedy.json")
GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
# largest float32 top-2 margin at which the dtype may first change a golden greedy token, and
# most golden prompts (of 14) it may change
MARGIN = {"float16": 1e-2, "bfloat16": 5e-2, "fp8_e4m3": 0.7, "fp8_e5m2": 0.7}
MOST_CHANGED = {"float16": 2, "bfloat16": 4, "fp8_e4m3": 14, "fp8_e5m2": 14}
MIN_AGREEMENT = {"turboquant_3.5": 0.9}


def first_difference(got: list[int], ref: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None)


@pytest.mark.parametrize("dtype", list(MARGIN))
def test_greedy_tokens_match_the_oracle_except_near_ties(smollm2_path, smollm2_model, dtype):
    prompts = [{"prompt_token_ids": c["prompt_token_ids"]} for c in GOLDEN["cases"]]
    with LLM(str(smollm2_path), kv_cache_dtype=dtype, max_num_batched_tokens=256) as llm:
        outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    model, backend = smollm2_model
    changed = []
    for case, got in zip(GOLDEN["cases"], outputs, strict=True):
        assert len(got) == len(case["tokens"])
        diff = first_difference(got, case["tokens"])
        if diff is None:
            continue
        row = np.sort(prompt_logits(model, backend,
                                    case["prompt_token_ids"] + case["tokens"][:diff])[-1])
        margin = float(row[-1] - row[-2])
        changed.append((len(case["prompt_token_ids"]), diff, round(margin, 4)))
        assert margin < MARGIN[dtype], f"{dtype} changed a token at a margin of {margin:.3f}"
    print(dtype, "first differences (prompt length, step, float32 margin):", changed)
    assert len(changed) <= MOST_CHANGED[dtype]


@pytest.mark.parametrize("dtype", ["turboquant_3.5"])   # fp8 reads through the same code
def test_chunking_preemption_and_prefix_caching_keep_tokens(smollm2_path, dtype):
    from vllm_actors.kernels.cpu.backend import CpuBackend
    from vllm_actors.loaders.model_files import resolve_model
    from vllm_actors.models.registry import load_model

    system = LONG_ESSAY[:1200]
    prompts = [f"{system}\n\nQuestion {i}: what does the text say about point {i}?"
               for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    # 26 blocks: the shared prefix (~18 blocks) and a few requests' own blocks
    with LLM(str(smollm2_path), kv_cache_dtype=dtype, max_num_seqs=8, max_model_len=400,
             num_gpu_blocks_override=26, max_num_batched_tokens=96) as llm:
        batch = llm.generate(prompts, params)
        again = [llm.generate([p], params)[0] for p in prompts]
        metrics = llm.get_metrics()
    assert metrics["vllm:num_preemptions"] > 0
    assert metrics["vllm:prefix_cache_hits"] > 0
    assert all(o.num_cached_tokens > 0 for o in again)
    backend = CpuBackend()
    model = load_model(resolve_model(smollm2_path), backend)
    fmt = kv_format(dtype)
    agree, total, margins = 0, 0, []
    for run in (batch, again):
        for out in run:
            prompt_ids = list(out.prompt_token_ids)
            got = list(out.outputs[0].token_ids)
            logits = prompt_logits(model, backend, prompt_ids + got, kv_format=fmt)
            steps = logits[len(prompt_ids) - 1:-1]
            plain = steps.argmax(axis=-1)
            agree += int((plain == np.array(got)).sum())
            total += len(got)
            top2 = np.sort(steps, axis=-1)[:, -2:]
            margins += [round(float(m), 3) for m in (top2[:, 1] - top2[:, 0])[plain != got]]
    print(dtype, f"agreement {agree}/{total}; margins where they differ: {margins}")
    assert agree / total >= MIN_AGREEMENT[dtype]
