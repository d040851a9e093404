"""SmolLM2 through the whole engine on a device backend (`--device opencl`, PoCL in CI;
`--device cuda` where CuPy sees a GPU): the same greedy tokens as the numpy backend, near-tie
rule (tests/parity.py)."""

import pytest
from opencl_platform import require_opencl
from parity import assert_same_or_near_tie

from vllm_actors import LLM, SamplingParams
from vllm_actors.errors import VllmActorsError

GREEDY_16 = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _skip_without(device: str) -> None:
    if device == "opencl":
        require_opencl()
    if device == "cuda":
        from vllm_actors.kernels.cuda.backend import cuda_available
        if not cuda_available():
            pytest.skip("no CUDA GPU visible to CuPy (bench/gpu_check.sh runs this)")


@pytest.mark.slow
@pytest.mark.parametrize("device", ["opencl", "cuda"])
def test_greedy_equals_numpy(device, smollm2_path, mixed_reference, smollm2_model,
                             mixed_prompts):
    _skip_without(device)
    # three prompts of 46, 65 and 218 tokens (3 to 14 KV blocks), generated as one batch
    by_length = sorted(mixed_prompts, key=lambda p: len(p["prompt_token_ids"]))
    prompts = [by_length[2], by_length[3], by_length[11]]
    reference = mixed_reference.of(prompts, GREEDY_16.max_tokens)   # the cpu backend
    with LLM(str(smollm2_path), device=device, gguf_activations="float32",
             kv_cache_memory=256 << 20, max_model_len=2048,
             enable_prefix_caching=False) as llm:
        outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY_16)]
    assert all(len(o) == 16 for o in outputs)
    assert_same_or_near_tie(smollm2_model, prompts, reference, outputs)


def test_bad_opencl_device_index_is_explained(smollm2_path):
    _skip_without("opencl")
    with pytest.raises(VllmActorsError, match="OpenCL device 99 does not exist"):
        LLM(str(smollm2_path), device="opencl", opencl_device=99, multiprocessing=False)
