"""Token parity with the near-tie rule: two greedy runs must agree, except where the first
difference sits on a near-tie (top-2 logit margin under NEAR_TIE), which is printed."""

from __future__ import annotations

import numpy as np
from model_driver import prompt_logits

from vllm_actors import SamplingParams
from vllm_actors.config import resolve_kv_dtype
from vllm_actors.kernels.kv_quant import kv_format

NEAR_TIE = 1e-4
# What the 32-prompt batching and process-split comparisons generate.
GREEDY_12 = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


class MixedReference:
    """The shared greedy reference of the mixed prompts (conftest's `mixed_reference`)."""

    def __init__(self, prompts: list[dict], tokens: list[list[int]], num_preemptions: int):
        self.num_preemptions = num_preemptions
        self.length = min(len(t) for t in tokens)    # tokens generated for every prompt
        self._by_prompt = {tuple(p["prompt_token_ids"]): t for p, t in zip(prompts, tokens,
                                                                           strict=True)}

    def of(self, prompts: list[dict], max_tokens: int) -> list[list[int]]:
        """The first `max_tokens` reference tokens of each of `prompts` (mixed prompts)."""
        assert max_tokens <= self.length
        return [self._by_prompt[tuple(p["prompt_token_ids"])][:max_tokens] for p in prompts]


def assert_same_or_near_tie(smollm2_model, prompts: list[dict], reference: list[list[int]],
                            outputs: list[list[int]]) -> None:
    model, backend = smollm2_model
    kv = kv_format(resolve_kv_dtype("auto", model.gguf_activations == "quantized"))
    for prompt, ref, got in zip(prompts, reference, outputs, strict=True):
        diff = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None)
        if diff is None:
            assert got == ref
            continue
        ids = prompt["prompt_token_ids"] + ref[:diff]
        row = np.sort(prompt_logits(model, backend, ids, kv_format=kv,
                                    first_row=len(ids) - 1)[-1])
        margin = float(row[-1] - row[-2])
        print(f"{len(prompt['prompt_token_ids'])}-token prompt: differs at step {diff}, "
              f"top-2 margin {margin:.2e}")
        assert margin < NEAR_TIE
